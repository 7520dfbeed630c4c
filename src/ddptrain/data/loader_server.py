"""Imported first, and only, by the forkserver that starts loader workers (data.worker_context's preload):
it takes the forkserver out of the trainer's signals.

Preemption signals are for the training process, which checkpoints and then stops its loader workers.
torchelastic signals each worker's whole process group and SLURM's --signal every process of the step: a
forkserver in the trainer's group would die of them, and every loader worker with it (torch's worker loop
exits when its parent, the forkserver, is gone) before the preemption checkpoint's step has its batches. So
the forkserver leaves the group and ignores them; it still ends with its trainer, whose end closes the pipe
the forkserver watches. Workers forked from it restore the default SIGTERM and SIGINT (data.worker_init).
"""

import os
import signal

os.setpgrp()
for _signal in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
    signal.signal(_signal, signal.SIG_IGN)
