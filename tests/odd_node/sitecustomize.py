"""Makes one rank of `ddptrain doctor` look like a node with an unshared disk and different code.

On PYTHONPATH (Python imports `sitecustomize` at start-up) with ODD_NODE_RANK set: in the worker whose RANK
is ODD_NODE_RANK, `doctor._probe_run_dir` probes a private temporary directory instead of the run dir, and
`doctor.code_hash` returns ODD_NODE_CODE_HASH. The rank is read when they are called, not at start-up: the
local launcher's workers are forked from a process that started before it had a rank. Every other process
and rank is left alone. tests/tools/test_doctor.py uses it, so that the problem reports are tested on one machine
without a test hook in the product.
"""

import os

if os.environ.get("ODD_NODE_RANK") is not None:
    import shutil
    import tempfile
    from pathlib import Path

    from ddptrain.tools import doctor

    def _odd() -> bool:
        return os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("ODD_NODE_RANK")

    _probe_shared_run_dir, _real_code_hash = doctor._probe_run_dir, doctor.code_hash

    def _probe_run_dir(ctx, run_dir: Path) -> tuple[str, list[int]]:
        if not _odd():
            return _probe_shared_run_dir(ctx, run_dir)
        private = Path(tempfile.mkdtemp(prefix="ddptrain-private-"))
        try:
            return _probe_shared_run_dir(ctx, private)
        finally:
            shutil.rmtree(private, ignore_errors=True)

    def _code_hash() -> str:
        if _odd() and os.environ.get("ODD_NODE_CODE_HASH"):
            return os.environ["ODD_NODE_CODE_HASH"]
        return _real_code_hash()

    doctor._probe_run_dir, doctor.code_hash = _probe_run_dir, _code_hash
