"""The embedded task: find the one digit hidden in a short sentence and answer with it.

It exists so that a random-init tiny model shows learning within minutes on a laptop CPU: copying
the one digit needs a single attention head (supervised, the embedded model learns it in under 10
steps). The reward's half credit is what makes RL find it. Measured: a prompt-independent "format"
credit (0.5 for any digit) let GRPO collapse the policy onto one fixed digit for 1 seed in 3, and
the copy was never found; here half credit is only earned by emitting *this* prompt's digit, so no
fixed output can farm it, yet a random 8-token sample earns it about 1 time in 60, enough for about
a quarter of groups of 16 to have reward variance at the start.
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


def _prompt(key: str) -> dict:
    # One Random per prompt, keyed by a string, so a prompt never depends on how many were asked for.
    rng = random.Random(key)
    d = rng.randrange(10)
    name, other = rng.sample(NAMES, 2)
    text = rng.choice(TEMPLATES).format(name=name, other=other, verb=rng.choice(VERBS), noun=rng.choice(NOUNS), d=d)
    return {"prompt": text + " answer:", "answer": str(d)}


def embedded_prompts(n: int, *, seed: int) -> list[dict]:
    """`n` prompts with their answers, a pure function of (n, seed): prompt i is the same for any n > i."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [_prompt(f"tidal-embedded/{seed}/{i}") for i in range(n)]


def held_out_prompts(n: int, *, seed: int, train: int) -> list[dict]:
    """`n` evaluation prompts, none of which is among the first `train` training prompts of `seed`
    (drawn from their own stream; the task has ~1.1M distinct prompts, so few are skipped)."""
    seen = {p["prompt"] for p in embedded_prompts(train, seed=seed)}
    out, i = [], 0
    while len(out) < n:
        p = _prompt(f"tidal-embedded-eval/{seed}/{i}")
        i += 1
        if p["prompt"] not in seen:
            seen.add(p["prompt"])  # no duplicate within the split either
            out.append(p)
    return out


def embedded_reward(prompt: str, response: str, sample: dict) -> float:
    """1 if the first digit of the response is the answer, 0.5 if the answer is a later digit, else 0."""
    del prompt  # the answer travels in `sample`; the prompt is part of the reward signature only
    digits = [c for c in response if c in "0123456789"]  # ASCII only: str.isdigit accepts "²"
    if digits and digits[0] == sample["answer"]:
        return 1.0
    return 0.5 if sample["answer"] in digits else 0.0


# ---- the multi-turn variant (`--set rollout=multi_turn`): the digit is behind a tool --------------

HIDDEN = "?"


def hide_digit(row: dict) -> dict:
    """The embedded prompt with its digit hidden, ending in `read` where the sentence ends in `answer:`
    (`ana has ? apples . how many ? read`), and the `lookup` environment's answer to a look: the digit,
    ending in `answer:` (` it is 7 . answer:`). Why these forms: tidal/executors/environments/lookup.py."""
    hidden = row["prompt"].replace(row["answer"], HIDDEN, 1).removesuffix(" answer:") + " read"
    return {"prompt": hidden, "answer": row["answer"], "reveal": f" it is {row['answer']} . answer:"}


def lookup_reward(prompt: str, response: str, sample: dict) -> float:
    """The embedded reward of the model's last turn, earned only after a look (an observation before
    that turn): an answer without one is a guess, and a guess scores 0 however lucky."""
    del prompt, response
    turns = sample["turns"]
    looked = any(t["role"] == "tool" for t in turns[:-1])
    last = turns[-1]
    if not looked or last["role"] != "assistant":
        return 0.0
    return embedded_reward("", last["text"], sample)
