"""Imported first, and only, by a forkserver that ddptrain starts processes from: the training workers of
`--nproc` (parallel.launch) and the loader workers of a trainer (data.pipeline.worker_context). It takes the
forkserver out of the job's signals.

Preemption signals are for the training processes, which checkpoint and then stop. torchelastic signals each
worker, and SLURM's --signal every process of the step: a forkserver in the job's process group would die of
them, and with the loader's, every loader worker (torch's worker loop exits when its parent, the forkserver,
is gone) before the preemption checkpoint's step has its batches; with the launcher's, a restart would pay
for the imports again. So the forkserver leaves the group and ignores them; it still ends with the process
that started it, whose end closes the pipe the forkserver watches. Processes forked from it restore the
default SIGTERM and SIGINT (`launch._worker`, `data.pipeline.worker_init`).

The forkserver also ends without the interpreter's teardown: once its last client has gone, collecting the
garbage of a process that imported torch and the trainer takes seconds (docs/performance.md, "Costs the code
is shaped by"), during which the launch's output pipe stays open and the resource tracker waits for it. The
last exit handler (registered first) ends it once the others ran.

Import it nowhere else: importing it is what it does.
"""

import atexit
import os
import signal
import sys

os.setpgrp()
for _signal in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
    signal.signal(_signal, signal.SIG_IGN)


@atexit.register
def _end_without_teardown() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)
