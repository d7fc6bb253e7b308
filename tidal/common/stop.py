"""The process-wide flag of a stop request that abandons the step in flight.

A stop (SIGTERM, SIGINT, a preemption notice) must end in a checkpoint within seconds, however long
a step is. Nothing of a step changes what a checkpoint holds until its barrier (the weights, the
optimizer and the schedule step there; prompts and seeds are functions of (seed, step, index)), so
the state at the step's start is the previous step's checkpoint: the step in flight can be dropped
and redone after a resume. When every rank has agreed to drop it (tidal/controller/control.py), `ABORT`
is set on each; the long loops check it between safe units of work (a decode iteration, a reward
call) and wind down, and the channels still deliver every item already sent, so the step ends
cleanly and quickly.
"""
from __future__ import annotations

import threading

ABORT = threading.Event()  # set once per process: a run whose step was abandoned ends after it


def aborted() -> bool:
    return ABORT.is_set()


class StepAborted(BaseException):
    """Raised inside an executor's step once ABORT is set (e.g. by a reward call being waited for);
    the controller receives the rest of the step's inbound items and ends the step. A BaseException,
    like KeyboardInterrupt: no `except Exception` around user code may swallow it."""
