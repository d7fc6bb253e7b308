"""A failed rank ends the whole job quickly, and every rank's last line names the cause.

Each rank runs a watchdog thread. It polls the store's `failed` key and exits when another rank has
published a failure there; it also checks that its peers are alive, so a rank killed without a word
(kill -9, the OOM killer) is named too, instead of its peers blaming the broken connection they see.

- A peer on this host is dead when its process is gone or a zombie (/proc).
- A peer on another host is dead when its heartbeat counter in the store has not moved for
  `dead_after_s`; generous, because a rank may hold the GIL a while.
- The first failure recorded stands (compare-and-set). A rank whose own error only echoes a peer's
  (a connection reset, a store or collective timeout) first waits briefly for the cause to be
  recorded, so it reports that, not the echo.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

from tidal.controller.world import store_client

_KEY = "failed"
EXIT_CODE = 17
# errors that a peer's death or failure causes on the ranks still talking to it
_ECHOES = ("Connection reset", "Connection closed", "Connection refused", "Broken pipe", "Socket Timeout",
           "Timed out", "timed out", "wait timeout", "DistNetworkError", "DistStoreError", "lost the job's store")


class Watchdog:
    def __init__(self, *, rank: int, roles: dict[int, str], interval_s: float = 0.2, dead_after_s: float = 15.0):
        self.rank, self.roles, self.interval_s, self.dead_after_s = rank, roles, interval_s, dead_after_s
        self.executor = roles[rank]
        self._store = store_client(timedelta(seconds=10))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tidal-watchdog", daemon=True)
        self._store.set(f"proc/{rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        self._peers: dict[int, dict] = {}
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (last counter seen, when it last moved)
        self._last_words: Callable[[], None] = lambda: None

    def before_exit(self, last_words: Callable[[], None]) -> None:
        """Run `last_words` (bounded in time) before this rank exits on a failure, its own or a
        peer's: rank 0 prints the rows of the steps that finished (MetricsWriter.drain)."""
        self._last_words = last_words

    def name(self, rank: int) -> str:
        return f"rank {rank} ({self.roles.get(rank, '?')})"

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """This rank ends normally: its exit is not a death. The thread is joined, not left to the
        interpreter's exit: a daemon thread coming back from a store call during finalization is ended
        by pthread_exit, whose unwinding through C++ frames aborts the process (seen once in the
        suite: `terminate called without an active exception`, exit -6, after a finished run)."""
        self._store.set(f"done/{self.rank}", "1")
        self._stop.set()
        self._thread.join(timeout=30)

    def _watch(self) -> None:
        tick = 0
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(f"beat/{self.rank}", 1)
                message = self.recorded()
                if message is None and tick % 5 == 0:
                    dead = self.dead_peer()
                    message = publish_first(self._store, dead) if dead else None
            except Exception as exc:  # the store lives with the agent / rank 0: it is gone, so is the job
                message = f"lost the job's store ({type(exc).__name__}); another rank or torchrun died"
            tick += 1
            if message and not self._stop.is_set():
                self._say_last_words()
                say(f"tidal: {self.name(self.rank)} stopping: {message}")
                os._exit(EXIT_CODE)

    def recorded(self) -> str | None:
        return self._store.get(_KEY).decode() if self._store.check([_KEY]) else None

    def dead_peer(self) -> str | None:
        """A message naming a peer that died without reporting, or None."""
        here, now = socket.gethostname(), time.monotonic()
        for rank in self.roles:
            if rank == self.rank:
                continue
            if rank not in self._peers:
                if not self._store.check([f"proc/{rank}"]):
                    continue  # not started yet
                self._peers[rank] = json.loads(self._store.get(f"proc/{rank}"))
            peer = self._peers[rank]
            if self._store.check([f"done/{rank}"]):
                continue  # ended normally
            if peer["host"] == here:
                if not _alive(peer["pid"]):
                    return f"{self.name(rank)} died without an error (killed by a signal, or out of memory?)"
                continue
            count = self._store.add(f"beat/{rank}", 0)
            seen, since = self._beats.get(rank, (-1, now))
            if count != seen:
                self._beats[rank] = (count, now)
            elif now - since > self.dead_after_s:
                return f"{self.name(rank)} sent no heartbeat for {now - since:.0f} s (its host {peer['host']} or " \
                       f"the process died, or it hangs holding the GIL)"
        return None

    def fail(self, exc: BaseException) -> None:
        """Publish this rank's failure and exit at once (never returns). An echo of a peer's failure
        waits up to a few seconds for the cause, and reports that instead."""
        own = f"{self.name(self.rank)} failed: {type(exc).__name__}: {exc}"
        try:
            cause = self._cause_of_echo(exc) if is_echo(exc) else None
            if cause is None:
                publish_first(self._store, own)  # first: the peers stop while this rank says its last words
                self._say_last_words()
                traceback.print_exception(exc, file=sys.stderr)
                say(f"tidal: {own}")
            else:
                self._say_last_words()
                say(f"tidal: {self.name(self.rank)} stopping: {cause}")
        except Exception:  # the store is gone: say what this rank saw
            say(f"tidal: {own}")
        finally:
            os._exit(EXIT_CODE)  # skip atexit/destructors: they may block on dead peers

    def _say_last_words(self) -> None:
        try:
            self._last_words()
        except Exception as exc:  # the failure being reported matters more
            say(f"tidal: {self.name(self.rank)}: could not print the finished steps ({type(exc).__name__}: {exc})")

    def _cause_of_echo(self, exc: BaseException, *, wait_s: float = 3.0) -> str | None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            cause = self.recorded()
            if cause is None:
                dead = self.dead_peer()
                cause = publish_first(self._store, dead) if dead else None
            if cause is not None:
                return cause
            time.sleep(self.interval_s)
        return None


def say(line: str) -> None:
    """One line to stderr in one write: ranks share the terminal (or pipe), and os._exit follows."""
    sys.stderr.flush()
    os.write(2, (line + "\n").encode(errors="replace"))


def is_echo(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(mark in text for mark in _ECHOES)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def publish_first(store, message: str) -> str:
    """Record `message` as the job's failure unless one is recorded already; return the one that stands.

    Compare-and-set, not set: a first failure (a raising reward) makes its peers fail in turn
    (connection closed), and an overwrite would have every rank report that echo instead of the cause.
    """
    return store.compare_set(_KEY, "", message).decode()
