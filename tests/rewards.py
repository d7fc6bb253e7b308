"""Reward callables used by e2e tests through the `module:function` config path."""
import time

from executors.embedded.task import embedded_reward


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
