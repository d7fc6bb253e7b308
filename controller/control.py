"""Per-step decisions every rank takes together: save a checkpoint after this step? stop after it?

Global rank 0 decides each step once its streamed phase is over and publishes the decision in the
store; every other rank reads it after its own streamed phase, before its barrier. That is early
enough for the trainer to skip its weight push when the run stops (nobody would receive it) and costs
no waiting: the trainer's streamed phase ends after the generator's anyway.

A stop is requested by SIGTERM or SIGINT to any rank (torchrun forwards them to every rank): the
request is seen at the next decision, the step finishes, a checkpoint is written at its barrier and
every rank exits with 128 + the signal number. A second signal (2 s or more later) exits at once.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from controller.checkpoint import tmp_dir

_STOP = "stop"  # value: the signal number, first signal wins
_wakeup: tuple | None = None


def _decision_key(step: int) -> str:
    return f"decision/{step}"


@dataclass(frozen=True)
class Decision:
    checkpoint: bool
    stop: bool
    signum: int = 0

    @classmethod
    def read(cls, store, step: int) -> "Decision":
        return cls(**json.loads(store.get(_decision_key(step))))


@dataclass
class Cadence:
    """When to checkpoint: every `every` steps and/or every `minutes` of wall time (0: off)."""

    every: int = 0
    minutes: float = 0.0
    keep: int = 2  # newest complete checkpoints kept (0: all)
    config: dict | None = None  # the run's resolved config, recorded in each checkpoint


class StepControl:
    def __init__(self, *, store, rank: int, cadence: Cadence, run_dir: Path):
        self.store, self.rank, self.cadence, self.run_dir = store, rank, cadence, run_dir
        self._last_save = time.monotonic()

    def decide(self, step: int) -> Decision:
        if self.rank == 0:
            raw = self.store.get(_STOP).decode() if self.store.check([_STOP]) else ""
            c = self.cadence
            due = (c.every and (step + 1) % c.every == 0) or \
                  (c.minutes and time.monotonic() - self._last_save >= 60 * c.minutes)
            decision = Decision(checkpoint=bool(raw or due), stop=bool(raw), signum=int(raw or 0))
            if decision.checkpoint:
                self._last_save = time.monotonic()
                # a crashed attempt's half-written directory for this step must not leak into the new one
                shutil.rmtree(tmp_dir(self.run_dir, step), ignore_errors=True)
            self.store.set(_decision_key(step), json.dumps(decision.__dict__))
            return decision
        return Decision.read(self.store, step)


def install_stop_signals(store) -> None:
    """SIGTERM/SIGINT request a stop at the next step's end instead of killing the rank mid-write.

    The request is posted by a thread woken through `signal.set_wakeup_fd`: the C-level handler
    writes the signal number to a socket at once, even while the main thread sits in a blocking
    receive (a Python-level handler would run only when that call returns).
    """
    global _wakeup
    reader, writer = _wakeup = socket.socketpair()  # kept alive here: a collected socket closes its fd
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)  # the wakeup byte does the work

    def watch() -> None:
        first = None
        while True:
            data = reader.recv(16)
            for signum in data:
                if signum not in (signal.SIGTERM, signal.SIGINT):
                    continue
                if first is not None:
                    # Ctrl-C reaches a rank twice (the terminal's SIGINT, then torchrun's copy): only a
                    # signal well after the first means "quit now"
                    if time.monotonic() - first > 2.0:
                        os._exit(128 + signum)
                    continue
                first = time.monotonic()
                try:
                    store.compare_set(_STOP, "", str(signum))
                    first_request = store.add("stop_requests", 1) == 1
                except Exception:  # the store is gone: the job is ending anyway
                    os._exit(128 + signum)
                if first_request:  # one line per job, not one per rank
                    # torchrun also sends SIGTERM to the survivors of a dead rank: then the watchdog
                    # ends this process within a second, and a "stopping after this step" would mislead
                    time.sleep(1.0)
                    if store.check(["failed"]):
                        continue
                    name = signal.Signals(signum).name
                    print(f"tidal: rank {os.environ.get('RANK', '0')} got {name}: stopping after this step "
                          f"(checkpoint first; {name} again to quit now)", file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="tidal-signals", daemon=True).start()
