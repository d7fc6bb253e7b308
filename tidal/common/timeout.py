"""User code called with a time limit (reward functions, environments): on one daemon thread per
process, so a call that hangs past its limit is abandoned without blocking the run's exit."""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from tidal.common.stop import StepAborted, aborted


class CallTimeout(Exception):
    """A call ran past its timeout (and was abandoned)."""


class _Worker:
    """One daemon thread that runs the calls in turn. Daemon: a call abandoned past its timeout
    must not keep the process from exiting (a ThreadPoolExecutor's threads are joined at exit)."""

    def __init__(self):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="tidal-call", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, args, box, done = self.calls.get()
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # handed to the caller, raised there
                box.append((False, exc))
            done.set()


_worker: _Worker | None = None


def _wait(done: threading.Event, timeout_s: float) -> bool:
    """done.wait(timeout_s), in slices: a stop request abandons the call (tidal/common/stop.py)."""
    deadline = time.monotonic() + timeout_s
    while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
        if aborted():
            raise StepAborted()
        if time.monotonic() >= deadline:
            return False
    return True


def call_with_timeout(fn: Callable, args: tuple, *, timeout_s: float):
    """`fn(*args)` on the worker thread, waited for at most `timeout_s`. A call past it is abandoned
    with its thread (Python cannot stop a thread; under on_error=zero it may keep a core busy until it
    returns) and the next call gets a new worker."""
    global _worker
    if _worker is None:
        _worker = _Worker()
    box, done = [], threading.Event()
    _worker.calls.put((fn, args, box, done))
    if not _wait(done, timeout_s):
        _worker = None
        raise CallTimeout()
    ok, value = box[0]
    if not ok:
        raise value
    return value
