"""Reward callables used by e2e tests through the `module:function` config path."""
import os
import time
from pathlib import Path

from tidal.modeling.tiny.task import embedded_reward


def slow_embedded(prompt: str, response: str, sample: dict) -> float:
    """The embedded reward, but slow: 0.05 s per response, and 0.3 s for one prompt in four (a slow
    grader). Scoring then takes most of a step, so the groups reach the trainer spread over it."""
    time.sleep(0.3 if sum(map(ord, prompt)) % 4 == 0 else 0.05)
    return embedded_reward(prompt, response, sample)


def boom(prompt: str, response: str, sample: dict) -> float:
    raise ZeroDivisionError("grader bug")


def nan_sometimes(prompt: str, response: str, sample: dict) -> float:
    return float("nan") if len(response) % 2 else 1.0


def length_parity(prompt: str, response: str, sample: dict) -> float:
    """A dense test reward: 1 for responses of odd text length. Almost every group has variance."""
    return float(len(response) % 2)


def flat_for_half_the_prompts(prompt: str, response: str, sample: dict) -> float:
    """0 for every response to half of the prompts (flat groups for dynamic sampling to drop),
    `length_parity` for the others (groups with variance to keep)."""
    return 0.0 if sum(map(ord, prompt)) % 2 == 0 else length_parity(prompt, response, sample)


def hang(prompt: str, response: str, sample: dict) -> float:
    """A grader stuck for good (a deadlock, an endless regex)."""
    while True:
        time.sleep(1)


_calls = 0


def length_parity_then_stall(prompt: str, response: str, sample: dict) -> float:
    """`length_parity`, except that with TIDAL_TEST_STALL_AFTER=N in the environment every call after
    the N-th stalls for 1000 s (a step far longer than any launcher waits), after touching the file
    TIDAL_TEST_STALL_FILE so a test knows the step is stuck."""
    global _calls
    _calls += 1
    after = os.environ.get("TIDAL_TEST_STALL_AFTER")
    if after is not None and _calls > int(after):
        Path(os.environ["TIDAL_TEST_STALL_FILE"]).touch()
        time.sleep(1000)
    return length_parity(prompt, response, sample)
