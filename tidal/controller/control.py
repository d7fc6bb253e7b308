"""Per-step decisions every rank takes together: save a checkpoint after this step? stop after it?
drop it?

The decider is the first rank of the last executor in graph order (the trainer: its streamed phase
ends last). It decides each step when its streamed phase is over and publishes the decision in the
store; every other rank reads it after its own streamed phase, before its barrier. That is early
enough for the trainer to skip its weight push when the run stops (nobody would receive it) and costs
no waiting: the other executors' next step waits for the trainer's barrier anyway.

Under the offpolicy schedule the generator runs a step ahead: it reads the decision of step k at the
end of its step k+1, and a stop after step k drops its step k+1 (the consumers drain what it sent).

A stop is requested by SIGTERM or SIGINT to any rank (torchrun forwards them to every rank). It must
not wait for the step to end: a real model's step can outlast the launcher's patience. So while the
decider is inside a step, a stop turns that step's decision into an *abort*, published at once: the
step is dropped (no barrier), the checkpoint of the step before it is written (unless it exists: the
state at a step's start is exactly that step's checkpoint, tidal/common/stop.py), and every rank exits with
128 + the signal number. The generator stops decoding at its next iteration and the reward after the
call in flight; the step's items already sent are still received, so the channels end cleanly. A stop
that arrives after the decision (during the barrier) lets the step finish and checkpoints it. A second
signal (2 s or more later) exits at once.
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

from tidal.common.stop import ABORT
from tidal.controller.checkpoint import MANIFEST, step_dir, tmp_dir

_STOP = "stop"  # value: the signal number, first signal wins
_wakeup: tuple | None = None


def decision_key(step: int) -> str:
    return f"decision/{step}"


@dataclass(frozen=True)
class Decision:
    checkpoint: bool  # after this step's barrier; with `abort`: of the step before it, now
    stop: bool
    signum: int = 0
    abort: bool = False  # drop this step: no barrier, the run ends with the step before it

    @classmethod
    def read(cls, store, step: int) -> "Decision":
        raw = store.get(decision_key(step))
        while not raw:
            # torch 2.13's TCPStore client: a blocking get on a client that has done blocking queue
            # pops (a channel's) can come back empty before the key is set (dapo's generator, every
            # step). The key is set once and never emptied: wait for it again.
            time.sleep(0.01)
            raw = store.get(decision_key(step))
        return cls(**json.loads(raw))


@dataclass
class Cadence:
    """When to checkpoint: every `every` steps and/or every `minutes` of wall time (0: off)."""

    every: int = 0
    minutes: float = 0.0
    keep: int = 2  # newest complete checkpoints kept (0: all)
    config: dict | None = None  # the run's resolved config, recorded in each checkpoint


class StepControl:
    def __init__(self, *, store, watch_store, rank: int, decider: int, cadence: Cadence, run_dir: Path,
                 ahead: bool = False):
        """watch_store: a store client of its own for the abort watcher's thread. ahead: this rank
        runs a step ahead of the decider (the offpolicy schedule's generator)."""
        self.store, self.rank, self.decider, self.cadence, self.run_dir = store, rank, decider, cadence, run_dir
        self.ahead = ahead
        self._last_save = time.monotonic()
        self._checkpointed: int | None = None  # the decider's last step decided with a checkpoint
        self.current: int | None = None  # the step this rank is in (the watcher's view)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(watch_store,), name="tidal-abort", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Joined before the process exits: a daemon thread still in a store call at interpreter
        exit aborts the process (see tidal/controller/failure.py Watchdog.stop)."""
        self._closed.set()
        self._thread.join(timeout=30)

    def begin(self, step: int) -> None:
        self.current = step

    def decide(self, step: int, *, last: bool = False) -> Decision:
        """last: the run's last step, always checkpointed: the end of a run is a checkpoint, so a
        finished run can be extended (--resume --steps N)."""
        if self.rank != self.decider:
            return Decision.read(self.store, step)
        raw = self.store.get(_STOP).decode() if self.store.check([_STOP]) else ""
        c = self.cadence
        due = last or (c.every and (step + 1) % c.every == 0) or \
              (c.minutes and time.monotonic() - self._last_save >= 60 * c.minutes)
        decision = Decision(checkpoint=bool(raw or due), stop=bool(raw), signum=int(raw or 0))
        if decision.checkpoint:
            # a crashed attempt's half-written directory for this step must not leak into the new one
            shutil.rmtree(tmp_dir(self.run_dir, step), ignore_errors=True)
        # an abort published by the watcher while the step ran wins: every rank must take the same one
        self.store.compare_set(decision_key(step), "", json.dumps(decision.__dict__))
        decision = Decision.read(self.store, step)
        if decision.checkpoint and not decision.abort:
            self._last_save, self._checkpointed = time.monotonic(), step
        return decision

    def _abort(self, step: int, signum: int) -> None:
        """The decider drops `step` (if its decision is not out yet) and saves the step before it,
        unless that one is saved already or being saved (decided at the previous step)."""
        prev = step - 1
        save = prev >= 0 and self._checkpointed != prev and not (step_dir(self.run_dir, prev) / MANIFEST).is_file()
        if save:
            shutil.rmtree(tmp_dir(self.run_dir, prev), ignore_errors=True)
        decision = Decision(checkpoint=save, stop=True, signum=signum, abort=True)
        self.store.compare_set(decision_key(step), "", json.dumps(decision.__dict__))

    def _watch(self, store) -> None:
        """Every rank: once a stop is requested, set ABORT when this rank's step is aborted; the
        decider publishes the abort for the step it is in."""
        while not ABORT.is_set() and not self._closed.wait(0.2):
            try:
                step = self.current
                if step is None or not store.check([_STOP]):
                    continue
                key = decision_key(step)
                if self.rank == self.decider and not store.check([key]):
                    self._abort(step, int(store.get(_STOP).decode() or 0))
                if store.check([key]) and Decision.read(store, step).abort:
                    ABORT.set()
                # a rank running ahead: the run ends before the step it is in when the step before it stops
                before = decision_key(step - 1)
                if self.ahead and store.check([before]) and Decision.read(store, step - 1).stop:
                    ABORT.set()
            except Exception:  # the store is gone: the job is ending anyway
                return


def install_stop_signals(store) -> None:
    """SIGTERM/SIGINT request a stop (at the next safe point, checkpoint first) instead of killing
    the rank mid-write.

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
                    # ends this process within a second, and a "stopping at the next safe point" would mislead
                    time.sleep(1.0)
                    if store.check(["failed"]):
                        continue
                    name = signal.Signals(signum).name
                    print(f"tidal: rank {os.environ.get('RANK', '0')} got {name}: stopping at the next safe point "
                          f"(checkpoint first; {name} again to quit now)", file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="tidal-signals", daemon=True).start()
