"""The embedded task: find the one digit hidden in a short sentence and answer with it.

It exists so that a random-init tiny model can show learning within minutes on a laptop CPU:
copying a token that the prompt marks by its kind (the only digit) needs one attention head,
and tied embeddings make copying the natural first thing to learn. The reward gives half credit
for answering with any digit, so the first groups already have non-zero reward variance.
"""
from __future__ import annotations

import random

NAMES = ("ana", "bo", "cy", "dee", "eli", "fay", "gus", "hal", "ivy", "jo", "kit", "lou")
NOUNS = ("apples", "cats", "boats", "cups", "dogs", "eggs", "hats", "keys", "pens", "rocks", "socks", "trees")
VERBS = ("has", "sees", "finds", "wants", "keeps", "sells", "paints", "counts")
TEMPLATES = (
    "{name} {verb} {d} {noun} . how many ?",
    "there are {d} {noun} near {name} . how many ?",
    "{d} {noun} for {name} . how many ?",
    "{name} and {other} {verb} {d} {noun} . how many ?",
)


def embedded_prompts(n: int, *, seed: int) -> list[dict]:
    """`n` prompts with their answers, a pure function of (n, seed): prompt i is the same for any n > i."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    out = []
    for i in range(n):
        # One Random per prompt, keyed by (seed, i), so a prompt never depends on how many were asked for.
        rng = random.Random(f"tidal-embedded/{seed}/{i}")
        d = rng.randrange(10)
        name, other = rng.sample(NAMES, 2)
        text = rng.choice(TEMPLATES).format(
            name=name, other=other, verb=rng.choice(VERBS), noun=rng.choice(NOUNS), d=d
        )
        out.append({"prompt": text + " answer:", "answer": str(d)})
    return out


def embedded_reward(prompt: str, response: str, sample: dict) -> float:
    """0.5 if the response contains a digit, plus 0.5 if its first digit is the answer."""
    del prompt  # the answer travels in `sample`; the prompt is part of the reward signature only
    digits = [c for c in response if c in "0123456789"]  # ASCII only: str.isdigit accepts "²"
    if not digits:
        return 0.0
    return 0.5 + (0.5 if digits[0] == sample["answer"] else 0.0)
