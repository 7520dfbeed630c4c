"""Makes one rank of `ddptrain doctor` look like a node with an unshared disk and different code.

On PYTHONPATH (Python imports `sitecustomize` at start-up), in the worker whose RANK is ODD_NODE_RANK:
`doctor._probe_run_dir` probes a private temporary directory instead of the run dir, and `doctor.code_hash`
returns ODD_NODE_CODE_HASH. Every other process is left alone. tests/test_doctor.py uses it, so that the
problem reports are tested on one machine without a test hook in the product.
"""

import os

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("ODD_NODE_RANK"):
    import shutil
    import tempfile
    from pathlib import Path

    from ddptrain.tools import doctor

    _probe_shared_run_dir = doctor._probe_run_dir

    def _probe_private_dir(ctx, run_dir: Path) -> tuple[str, list[int]]:
        private = Path(tempfile.mkdtemp(prefix="ddptrain-private-"))
        try:
            return _probe_shared_run_dir(ctx, private)
        finally:
            shutil.rmtree(private, ignore_errors=True)

    doctor._probe_run_dir = _probe_private_dir
    if os.environ.get("ODD_NODE_CODE_HASH"):
        doctor.code_hash = lambda: os.environ["ODD_NODE_CODE_HASH"]
