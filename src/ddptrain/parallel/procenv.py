"""A new job's environment and rendezvous port, for whatever starts ddptrain processes (tests, benchmarks)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

# What a launcher (torchrun's elastic agent, SLURM) or ddptrain sets for its workers. A process that inherits
# them believes it is a worker of that job, so a new job starts without them.
JOB_VAR_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC", "SLURM_",
                    "DDPTRAIN_")


def fresh_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` (default os.environ) without any job's variables (JOB_VAR_PREFIXES)."""
    return {k: v for k, v in (os.environ if environ is None else environ).items()
            if not k.startswith(JOB_VAR_PREFIXES)}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it); another process could take it before it is bound."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
