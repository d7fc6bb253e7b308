"""A rank that raises ends the whole job quickly, naming itself; a wrong world size fails fast."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.common.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(nproc: int, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("who,rank", [("relay", 1), ("producer", 0)])
def test_raising_rank_ends_job_naming_it(tmp_path, who, rank):
    # the collective timeout is 600 s: only the watchdog can end this job within the deadline
    proc, took = _torchrun(3, "tests/toy_job.py", "--fail", who, "--output-dir", str(tmp_path), timeout=400)
    assert proc.returncode != 0
    assert took < 60, took
    assert f"rank {rank} ({who}) failed: RuntimeError: {who} fails on purpose at step 1" in proc.stderr


def test_clean_toy_job_exits_zero(tmp_path):
    proc, _ = _torchrun(3, "tests/toy_job.py", "--output-dir", str(tmp_path), timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_wrong_world_size_fails_fast_naming_both_numbers(tmp_path):
    proc, took = _torchrun(2, "launch.py", "--algo", "grpo", "--output-dir", str(tmp_path), timeout=300)
    assert proc.returncode != 0
    # issue target: < 10 s on an idle machine (measured in the note); the bound here catches hangs
    # without flaking when CI shares its 2 cores
    assert took < 30, took
    assert ("world size is 2, but placement=split needs --nproc-per-node 3 (generator 1 + reward 1 + trainer 1); "
            "placement=colocated --schedule sync needs 1") in proc.stderr


def test_first_failure_stands():
    from datetime import timedelta

    import torch.distributed as dist

    from tidal.controller.failure import publish_first

    # the watchdog's kind of store: a prefix store over the job's TCPStore
    store = dist.PrefixStore("tidal", dist.TCPStore("127.0.0.1", free_port(), is_master=True,
                                                    timeout=timedelta(seconds=30)))
    cause = "rank 1 (reward) failed: RewardError: reward 'boom' failed on prompt 0"
    assert publish_first(store, cause) == cause
    # the echo of the first failure on a peer does not replace it
    assert publish_first(store, "rank 0 (generator) failed: [gloo] Connection closed") == cause
    assert store.get("failed").decode() == cause


def test_a_receive_past_the_timeout_names_who_waits_on_whom():
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tidal.channels.channel import Channel, Receiver, Route
    from tidal.channels.kinds import Kind
    from tidal.channels.payloads import ScoredGroup

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=1))
    channel = Channel("scored", "reward", "trainer", Kind.SCATTER, ScoredGroup)
    rx = Receiver(channel=channel, route=Route(channel_id=2, src_units=((1,),), dst_units=((2,),)),
                  store=dist.PrefixStore("tidal", store), rank=2, device=torch.device("cpu"))
    rx.open_step(3)
    # the wait it reports is measured (1 s past the store's timeout of 1 s, 2 s on a loaded machine): not asserted
    with pytest.raises(TimeoutError, match=r"rank 2 \(trainer\) waited \d+ s on channel 'scored' \(step 3\) for "
                                           r"reward rank\(s\) \[1\], which did not finish sending"):
        list(rx)


def test_a_spurious_empty_queue_is_waited_out_within_the_deadline():
    """torch 2.13's TCPStore can answer a blocking queue_pop with QueueEmptyError before the deadline
    (seen once in CI). The receiver waits again; past the deadline it names who waits on whom."""
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tidal.channels.channel import Channel, Receiver, Route, _queue_key
    from tidal.channels.kinds import Kind
    from tidal.channels.payloads import ScoredGroup

    class Spurious:  # the real store, with the race's answer on the first `empties` pops
        def __init__(self, store, empties):
            self.store, self.empties, self.timeout = store, empties, store.timeout

        def queue_pop(self, key, block):
            if self.empties:
                self.empties -= 1
                raise dist.QueueEmptyError("queue is empty")
            return self.store.queue_pop(key, block)

    store = dist.PrefixStore("tidal", dist.TCPStore("127.0.0.1", free_port(), is_master=True,
                                                     timeout=timedelta(seconds=1)))
    channel = Channel("scored", "reward", "trainer", Kind.SCATTER, ScoredGroup)
    route = Route(channel_id=2, src_units=((1,),), dst_units=((2,),))
    for empties, step in ((3, 4), (10**9, 5)):
        rx = Receiver(channel=channel, route=route, store=Spurious(store, empties), rank=2, device=torch.device("cpu"))
        rx.open_step(step)
        store.queue_push(_queue_key(route, 2, step), json.dumps({"src": 1, "end": True}))
        if step == 4:
            assert list(rx) == []  # the end of the step got through
        else:
            with pytest.raises(TimeoutError, match=r"rank 2 \(trainer\) waited \d+ s on channel 'scored' \(step 5\) "
                                                   r"for reward rank\(s\) \[1\].*\(QueueEmptyError\)"):
                list(rx)
