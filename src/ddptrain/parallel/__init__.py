"""Parallelism and the process group.

Owns: the process group and its rank, host and device (`distributed`), the DDP / FSDP2 / HSDP strategies
(`strategies`), the local launcher behind `--nproc` (`launch`) and the forkserver its training workers and
the loaders' workers start from (`forkserver`), the collective watchdog that names a hung
rank and host (`watchdog`), and the network facts ranks exchange (`netinfo`, `procenv`).

May import: the contracts at the top (config, errors), `models` (a Hugging Face model's blocks to shard) and
`observe` (log paths). Never the loop, checkpoints or data.
"""
