"""Exceptions that map onto the documented exit codes.

0 success · 1 training failure · 2 usage/config error · 75 preempted (checkpoint committed, requeue me).
"""

import sys

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: "try again later" — what a scheduler requeue wants.


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message ('' if it has none): what went wrong, where torch's longer
    messages go on with advice and details."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class UsageError(Exception):
    """Bad input from the user: printed as one line on stderr, exit 2, no traceback.

    The message names the flag, file or variable at fault and how to fix it.
    """


class TrainingError(RuntimeError):
    """A failure during training that every rank agrees on (same message on each rank)."""


class WorkerFailed(TrainingError):
    """This rank's training failed; the cause is already logged, on stderr and in the launcher's error file."""


class Preempted(Exception):
    """Raised at a step boundary after the preemption checkpoint has committed on all ranks, or at the end of a
    complete run that a signal reached during its final save (`finished`)."""

    def __init__(self, step: int, signal_name: str, finished: bool = False):
        super().__init__(f"preempted by {signal_name} during the run's end, which finished: the run is complete at "
                         f"step {step}" if finished else f"preempted by {signal_name}: checkpoint at step {step} "
                         "committed")
        self.step = step
        self.signal_name = signal_name
        self.finished = finished  # the signal came during the final save, which went on to the end


def say_error(message: str) -> None:
    """One `ddptrain: error:` line in one write: under torchrun every rank shares the terminal, and `print`'s two
    writes (the text, then the newline) of two ranks can interleave into one garbled line."""
    sys.stderr.write(f"ddptrain: error: {message}\n")
    sys.stderr.flush()
