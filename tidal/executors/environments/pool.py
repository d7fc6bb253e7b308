"""Environment calls off the engine's decode loop (multi_turn.env_workers).

A tool takes 0.1-10 s (running code, a search, a judge). Called inline, each call stalled every sample
of its replica: 256 calls of 0.2 s made a 0.33 s step 51.9 s. Here a call is submitted and the engine
decodes on; it asks `ready()` each iteration for the answers that came back, and only waits when no
row has anything to decode.

Calls run on up to `workers` daemon threads (None: a thread for every call in flight; a hung call must not keep the process from exiting: a
ThreadPoolExecutor joins its threads at exit), or, for an environment whose method is `async def`, as
coroutines on one event-loop thread. A call past `timeout_s` is answered with CallTimeout and abandoned:
its thread leaves the pool when the call returns, and a new one takes its place. `abandon()` (a stop)
forgets every call in flight. workers=0 runs each call inline on submit (the serial behaviour, kept for
comparison: bench/multi_turn.py --latency).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from tidal.common.timeout import CallTimeout, call_with_timeout


@dataclass(frozen=True)
class Answer:
    key: Hashable  # what the caller submitted it under
    value: Any  # the call's return value, or the exception it raised (CallTimeout past its limit)
    ok: bool
    seconds: float  # from submission to the answer (the environment's time of this sample)


@dataclass
class _Call:
    key: Hashable
    fn: Callable
    args: tuple
    start: float
    deadline: float
    future: Any = None  # a coroutine's concurrent.futures.Future
    running: bool = False  # a thread has taken it


class EnvPool:
    def __init__(self, *, workers: int | None, timeout_s: float):
        self.workers, self.timeout_s = workers, timeout_s
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[int, _Call] = {}  # in flight, by ticket
        self._next, self._threads, self._idle, self._queued = 0, 0, 0, 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.blocked_s = 0.0  # the caller's time spent waiting on calls: in ready(), and in inline calls

    def submit(self, key: Hashable, fn: Callable, *args) -> None:
        """Start `fn(*args)`; its Answer comes back from `ready()` under `key`."""
        now = time.monotonic()
        if self.workers == 0:  # inline: the answer is ready at once
            try:
                value, ok = call_with_timeout(fn, args, timeout_s=self.timeout_s), True
            except Exception as exc:  # CallTimeout included; the rollout names it
                value, ok = exc, False
            self.blocked_s += time.monotonic() - now
            self._answers.put(Answer(key, value, ok, time.monotonic() - now))
            return
        call = _Call(key, fn, args, now, now + self.timeout_s)
        with self._lock:
            ticket, self._next = self._next, self._next + 1
            self._calls[ticket] = call
            start_thread = False
            if not asyncio.iscoroutinefunction(fn):  # a thread for it, unless an idle one has none queued
                self._queued += 1
                start_thread = self._idle < self._queued and (self.workers is None or self._threads < self.workers)
                self._threads += start_thread
        if asyncio.iscoroutinefunction(fn):
            call.future = asyncio.run_coroutine_threadsafe(fn(*args), self._event_loop())
            call.future.add_done_callback(lambda f, t=ticket: self._finish(t, *_outcome(f)))
            return
        if start_thread:
            threading.Thread(target=self._serve, name="tidal-env", daemon=True).start()
        self._jobs.put(ticket)

    def ready(self, *, wait_s: float = 0.0) -> list[Answer]:
        """The answers that came back (calls past their limit: CallTimeout), waiting up to `wait_s` for one."""
        begin = time.monotonic()
        end = begin + wait_s
        out: list[Answer] = []
        try:
            return self._collect(out, end)
        finally:
            if wait_s > 0:  # a look without waiting is the decode loop's own time
                self.blocked_s += time.monotonic() - begin

    def _collect(self, out: list[Answer], end: float) -> list[Answer]:
        while True:
            while True:
                try:
                    out.append(self._answers.get_nowait())
                except queue.Empty:
                    break
            out += self._expire()
            now = time.monotonic()
            if out or now >= end:
                return out
            with self._lock:
                first = min((c.deadline for c in self._calls.values()), default=end)
            try:
                out.append(self._answers.get(timeout=max(0.0, min(end, first) - now)))
            except queue.Empty:
                pass

    def abandon(self) -> None:
        """Forget every call in flight (a stop abandons the step): their answers are dropped."""
        with self._lock:
            for call in self._calls.values():
                self._drop(call)
            self._calls = {}
        while True:
            try:
                self._answers.get_nowait()
            except queue.Empty:
                return

    def _expire(self) -> list[Answer]:
        now, out = time.monotonic(), []
        with self._lock:
            late = [t for t, c in self._calls.items() if c.deadline <= now]
            for ticket in late:
                call = self._calls.pop(ticket)
                out.append(Answer(call.key, CallTimeout(), False, now - call.start))
                self._drop(call)
        return out

    def _drop(self, call: _Call) -> None:
        """(under the lock) A call no one waits for: a coroutine is cancelled; a thread running one stops
        counting in the pool (it leaves when the call returns), so the next submit may start another."""
        if call.future is not None:
            call.future.cancel()
        elif call.running:
            self._threads -= 1

    def _serve(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            ticket = self._jobs.get()
            with self._lock:
                self._idle, self._queued = self._idle - 1, self._queued - 1
                call = self._calls.get(ticket)
                if call is not None:
                    call.running = True
            if call is None:  # timed out or abandoned before it started
                continue
            try:
                value, ok = call.fn(*call.args), True
            except Exception as exc:  # handed to the rollout, which names it
                value, ok = exc, False
            if not self._finish(ticket, value, ok):
                return  # past its limit or abandoned: _drop gave its place in the pool to a new thread

    def _finish(self, ticket: int, value, ok: bool) -> bool:
        with self._lock:
            call = self._calls.pop(ticket, None)
        if call is None:
            return False
        self._answers.put(Answer(call.key, value, ok, time.monotonic() - call.start))
        return True

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="tidal-env-async", daemon=True).start()
        return self._loop


def _outcome(future) -> tuple[Any, bool]:
    if future.cancelled():
        return CallTimeout(), False
    exc = future.exception()
    return (exc, False) if exc is not None else (future.result(), True)
