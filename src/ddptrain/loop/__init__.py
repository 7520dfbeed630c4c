"""The training loop and what varies in it.

Owns: the Trainer (one rank's loop, top to bottom), tasks and the loss contract, the loss normalisation
across ranks, the pre-training sanity batch, evaluation, the optimizer and schedule, a rank's RNG state, the
preemption signal, the per-step log line, which loaders a rank reads through (`loaders`), and the task, data
and model a config names, plug-in or built-in (`plugins`).

May import: the contracts at the top (config, errors, parts, faults) and every subpackage below the loop
(parallel, checkpoints, data, models, observe). Nothing below imports the loop.
"""
