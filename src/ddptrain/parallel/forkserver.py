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

Import it nowhere else: importing it is what it does.
"""

import os
import signal

os.setpgrp()
for _signal in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
    signal.signal(_signal, signal.SIG_IGN)
