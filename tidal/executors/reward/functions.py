"""Rule-based rewards: plain callables `(prompt, response, sample) -> float`.

`sample` is the data row's extra columns (e.g. `answer`). A reward is referenced in a config by a
registered name or by "module:function", so users add rewards without touching this package.
"""
from __future__ import annotations

import inspect
import math
import numbers
import re
from fractions import Fraction
from typing import Callable, Literal

from tidal.common.registry import Registry, load_attr
from tidal.common.timeout import CallTimeout, call_with_timeout
from tidal.modeling.tiny.task import embedded_reward, lookup_reward

RewardFn = Callable[[str, str, dict], float]


class RewardError(ValueError):
    """A reward function raised or returned something that is not a finite number."""


# ---- math_simple: the hand-written verifier ------------------------------------------------------

_BOXED = "\\boxed{"
# One candidate number in free text; longer forms come first so "3/4" is not read as "3".
_NUMBER_RE = re.compile(
    r"-?\\[dt]?frac\{[^{}]*\}\{[^{}]*\}"
    r"|-?\d+(?:\.\d+)?\s*/\s*\d+(?:\.\d+)?"
    r"|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?"
    r"|-?\d+(?:\.\d+)?"
    r"|-?\.\d+"
)
_FRAC_RE = re.compile(r"(-?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_TEXT_RE = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last balanced `\\boxed{...}` (nested braces allowed), else None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(_BOXED):i - 1]
        # Unbalanced (e.g. a truncated response): try the previous one.
        start = text.rfind(_BOXED, 0, start)
    return None


def _normalise(text: str) -> str:
    s = _TEXT_RE.sub(r"\1", text)
    # Escaped forms first, so "\\%" does not leave a stray backslash behind.
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\%", "%", "\\$", "$"):
        s = s.replace(junk, "")
    s = "".join(s.split()).rstrip(".")
    # "x = 5" -> "5": the value is what follows the last '='.
    return s.rsplit("=", 1)[-1]


def _to_number(text: str) -> Fraction | None:
    """Exact value of a number-like string (int, decimal, a/b, \\frac{a}{b}, 1,234), else None."""
    s = _normalise(text)
    m = _FRAC_RE.fullmatch(s)
    if m:
        num, den = _to_number(m.group(2)), _to_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        return -num / den if m.group(1) else num / den
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    if s.count("/") == 1:  # "a/b" with decimal parts, which Fraction() alone refuses
        num, den = (_to_number(part) for part in s.split("/"))
        return num / den if num is not None and den else None
    try:
        return Fraction(s)  # exact: "0.75" == "3/4", and 1/3 != 0.333
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the last \\boxed{...}, else the last number, else None."""
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed
    matches = _NUMBER_RE.findall(response)
    return matches[-1] if matches else None


def _answer(sample: dict, reward: str) -> str:
    """The row's gold answer as text (a number column compares as its text)."""
    if "answer" not in sample:
        raise ValueError(f"{reward} needs the data column 'answer'; the row has {sorted(sample)}")
    return str(sample["answer"])


def math_simple(prompt: str, response: str, sample: dict) -> float:
    """1.0 when the response's final answer (the last \\boxed{}, else the last number) equals
    `sample["answer"]`: exact numbers (0.75 == 3/4, 1/3 != 0.333), else the normalised text. No
    dependency, ~100x faster than math_verify, blind to sets, intervals and symbolic forms."""
    gold = _answer(sample, "math_simple")
    pred = extract_answer(response)
    if pred is None:
        return 0.0
    gold = _last_boxed(gold) or gold
    pred_num, gold_num = _to_number(pred), _to_number(gold)
    if pred_num is not None and gold_num is not None:
        return float(pred_num == gold_num)
    return float(_normalise(pred).lower() == _normalise(gold).lower())


# ---- math_verify: Hugging Face's math-verify ---------------------------------------------------

_MATH_VERIFY = None
# a gold already in math mode: \boxed{}, an unescaped $ (not the currency sign \$), \( or \[
_IN_MATH_MODE = re.compile(r"\\boxed|(?<!\\)\$|\\\(|\\\[")


def _math_verify_module():
    """Hugging Face's math-verify, imported on first use (it brings sympy and an ANTLR LaTeX parser)."""
    global _MATH_VERIFY
    if _MATH_VERIFY is None:
        import logging

        import math_verify as module

        # its signal-based timeouts cannot run in the reward's worker thread: they are off, and the
        # warning that says so is silenced; reward.timeout_s bounds every call instead
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        _MATH_VERIFY = module
    return _MATH_VERIFY


def math_verify(prompt: str, response: str, sample: dict) -> float:
    """1.0 when the response's final answer is mathematically equal to `sample["answer"]`, by Hugging
    Face's math-verify (what TRL and open-r1 use): LaTeX and plain expressions, fractions, sets,
    intervals, symbolic forms. A bare gold ("3/4", "\\frac{1}{2}", "[1,2)") is read as one LaTeX
    expression; a gold with \\boxed{} or $...$ (a worked solution) as written. ValueError for a
    gold it cannot read."""
    gold_text = _answer(sample, "math_verify")
    mv = _math_verify_module()
    gold = _parse_gold(mv, gold_text)
    # timeouts None: math-verify's are SIGALRM-based and raise outside the main thread
    pred = mv.parse(response, parsing_timeout=None)
    if not pred:  # no answer found in the response
        return 0.0
    return float(mv.verify(gold, pred, timeout_seconds=None))


def _parse_gold(mv, gold_text: str) -> list:
    """A bare gold is wrapped in $...$ so that math-verify reads all of it as one LaTeX expression:
    unwrapped, its extraction (made for free text) finds nothing at all in "[1,2)", "{1,2}" or
    "\\sqrt{2}/2". A gold it cannot read is a data error, not a 0 reward: every sample of the prompt
    would score 0, silently."""
    wrapped = gold_text if _IN_MATH_MODE.search(gold_text) else f"${gold_text}$"
    gold = mv.parse(wrapped, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math_verify cannot read the answer {gold_text!r}: math-verify finds no expression in it")
    return gold


# ---- registry and resolution -------------------------------------------------------------------

# the columns each reads, checked against the data file's first rows at launch (tidal/launch/preflight.py)
math_verify.columns = math_simple.columns = ("answer",)

def env_reward(prompt: str, response: str, sample: dict) -> float:
    """A multi-turn sample's reward parts from its environment (EnvStep.reward_parts), summed."""
    del prompt, response
    if "env" not in sample:
        raise ValueError("the `env` reward reads a multi-turn rollout's reward parts (rollout=multi_turn)")
    return float(sum(sample["env"].values()))


REWARDS: Registry[RewardFn] = Registry("reward")
REWARDS.register("math_verify", math_verify)
REWARDS.register("math_simple", math_simple)
REWARDS.register("embedded", embedded_reward)
REWARDS.register("embedded_lookup", lookup_reward)
REWARDS.register("env", env_reward)


def resolve_reward(spec: str) -> RewardFn:
    """A registered reward name, or "package.module:function" for a user's own callable; a callable
    that cannot take (prompt, response, sample) is refused here, at launch, not at its first call."""
    if ":" not in spec:
        return REWARDS.get(spec)
    fn = load_attr(spec, what=f"reward {spec!r}")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {spec.partition(':')[2]!r} is a {type(fn).__name__}, not callable")
    check_signature(fn, spec=spec)
    return fn


def check_signature(fn: Callable, *, spec: str) -> None:
    """ValueError unless `fn(prompt, response, sample)` binds; a callable without a readable signature
    (some builtins) passes, as it can only be checked by calling it."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind("prompt", "response", {})
    except TypeError:
        raise ValueError(f"reward {spec!r}: its signature {signature} cannot take the 3 positional arguments "
                         f"(prompt, response, sample) a reward is called with") from None


# a data row's own name for itself, when it has one (HumanEval: task_id), for error messages
ID_COLUMNS = ("id", "task_id", "uid", "problem_id")


def describe_row(*, prompt_index: int, data_row: int | None, sample: dict) -> str:
    """Where a prompt came from: "data row 17 (task_id HumanEval/16)", else its index in the step."""
    if data_row is None:
        return f"prompt {prompt_index}"
    column = next((c for c in ID_COLUMNS if c in sample), None)
    return f"data row {data_row}" + (f" ({column} {sample[column]})" if column else "")


def score_group(
    fn: RewardFn,
    *,
    name: str,
    prompt: str,
    responses: list[str],
    sample: dict | list[dict],
    prompt_index: int,
    on_error: Literal["fail", "zero"],
    timeout_s: float | None = None,
    data_row: int | None = None,
) -> tuple[list[float], dict[int, str]]:
    """Score the G responses of one prompt; returns (scores, {failed sample: its error message}).
    timeout_s: each call's limit; a call past it fails like one that raised. data_row: the prompt's
    line in its data file, named in errors (with the row's id column) instead of `prompt_index`.
    `sample`: the data row, or one dict per response (a multi-turn rollout's, with its turns)."""
    if on_error not in ("fail", "zero"):
        raise ValueError(f"on_error must be 'fail' or 'zero', got {on_error!r}")
    scores, errors = [], {}
    samples = sample if isinstance(sample, list) else [sample] * len(responses)
    row = describe_row(prompt_index=prompt_index, data_row=data_row, sample=samples[0] if samples else {})
    for sample_index, (response, sample) in enumerate(zip(responses, samples, strict=True)):
        try:
            value = fn(prompt, response, sample) if timeout_s is None else call_with_timeout(
                fn, (prompt, response, sample), timeout_s=timeout_s)
            # bool is a numbers.Real; a rule returning True/False is a fine 1/0 reward.
            if not isinstance(value, numbers.Real):
                raise TypeError(f"returned {type(value).__name__} {value!r}, not a number")
            if not math.isfinite(value):
                raise ValueError(f"returned non-finite {value!r}")
            scores.append(float(value))
        except Exception as e:  # any failure of user code is reported the same way
            where = f"on {row}, sample {sample_index}"
            message = (f"reward {name!r} timed out after {timeout_s:g} s {where}" if isinstance(e, CallTimeout)
                       else f"reward {name!r} failed {where}: {type(e).__name__}: {' '.join(str(e).split())}")
            if on_error == "fail":
                raise RewardError(message) from e
            scores.append(0.0)
            errors[sample_index] = message
    return scores, errors
