"""A failed rank ends the whole job quickly, with a message naming it.

The failing rank writes its message to the job's store and exits; every rank runs a watchdog thread
that polls that key and exits too. Collective timeouts alone would leave peers blocked for minutes.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from datetime import timedelta

from controller.world import store_client

_KEY = "failed"
EXIT_CODE = 17


class Watchdog:
    def __init__(self, *, rank: int, executor: str, interval_s: float = 0.2):
        self.rank, self.executor, self.interval_s = rank, executor, interval_s
        self._store = store_client(timedelta(seconds=10))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tidal-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                failed = self._store.check([_KEY])
                message = self._store.get(_KEY).decode() if failed else None
            except Exception as exc:  # the store lives with rank 0 / the agent: it is gone, so is the job
                message = f"lost the job's store ({type(exc).__name__}); another rank died"
            if message and not self._stop.is_set():
                print(f"tidal: rank {self.rank} ({self.executor}) stopping: {message}",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)

    def fail(self, exc: BaseException) -> None:
        """Publish this rank's failure and exit at once (never returns)."""
        message = f"rank {self.rank} ({self.executor}) failed: {type(exc).__name__}: {exc}"
        traceback.print_exception(exc, file=sys.stderr)
        print(f"tidal: {message}", file=sys.stderr, flush=True)
        try:
            publish_first(self._store, message)
        finally:
            os._exit(EXIT_CODE)  # skip atexit/destructors: they may block on dead peers


def publish_first(store, message: str) -> str:
    """Record `message` as the job's failure unless one is recorded already; return the one that stands.

    Compare-and-set, not set: a first failure (a raising reward) makes its peers fail in turn
    (connection closed), and an overwrite would have every rank report that echo instead of the cause.
    """
    return store.compare_set(_KEY, "", message).decode()
