"""`ddptrain ARGS` in this process (a torchrun worker, or a process alone), its peak resident set size written at
exit.

    python -m torch.distributed.run ... benchmarks/peak_rss.py OUT_DIR train [flags]
    python benchmarks/peak_rss.py OUT_DIR train [flags]

Writes OUT_DIR/rank-<RANK>.json: {"peak_rss_mb": ...} (ru_maxrss: the most this process ever held).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import sys
from pathlib import Path


def record(out: Path) -> None:
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    (out / f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"peak_rss_mb": peak_mb}))


if __name__ == "__main__":
    atexit.register(record, Path(sys.argv[1]))
    sys.argv = ["ddptrain", *sys.argv[2:]]
    from ddptrain.cli import entry

    raise SystemExit(entry())
