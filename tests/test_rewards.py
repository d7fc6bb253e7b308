"""Rule rewards: math_simple (math_verify: test_math_verify.py), reward resolution, and how reward
failures are reported."""
import math

import pytest

from executors.reward.functions import (
    REWARDS, RewardError, extract_answer, math_simple, math_verify, resolve_reward, score_group,
)


@pytest.mark.parametrize("response, answer, expected", [
    ("so the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("-\\frac{1}{2} is it: \\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("first \\boxed{1}, then corrected: \\boxed{2}", "2", 1.0),
    ("first \\boxed{1}, then corrected: \\boxed{2}", "1", 0.0),
    ("\\boxed{5} and a truncated \\boxed{6", "5", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{x = 7}", "7", 1.0),
    ("\\boxed{2.50}", "5/2", 1.0),
    ("\\boxed{\\text{B}}", "b", 1.0),
    ("They have 1,234 apples in total. The answer is 1,234.", "1234", 1.0),
    ("It costs 3.5 dollars, so 7/8 is left.", "0.875", 1.0),
    ("We get 12 then 13", 13, 1.0),  # a non-string answer column is compared as its text
    ("\\boxed{41}", "42", 0.0),
    ("\\boxed{0.333}", "1/3", 0.0),  # numbers compare exactly, not approximately
    ("I do not know.", "42", 0.0),
    ("\\boxed{\\text{A}}", "b", 0.0),
])
def test_math_simple(response, answer, expected):
    assert math_simple("q", response, {"answer": answer}) == expected


def test_extract_answer_handles_nested_braces():
    assert extract_answer("x \\boxed{\\frac{1}{\\sqrt{2}}} y") == "\\frac{1}{\\sqrt{2}}"
    assert extract_answer("no numbers here") is None


def test_math_simple_missing_answer_names_field():
    with pytest.raises(ValueError, match="'answer'"):
        math_simple("q", "\\boxed{1}", {"solution": "1"})


def test_resolve_reward():
    assert resolve_reward("math_verify") is math_verify
    assert resolve_reward("math:floor") is math.floor
    assert "math_verify" in REWARDS.names()
    with pytest.raises(ValueError, match="unknown reward 'nope'; known: embedded, math_simple, math_verify"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="'no_such_module_xyz:f'.*cannot import"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="'math:nope'.*no attribute 'nope'"):
        resolve_reward("math:nope")
    with pytest.raises(ValueError, match="'math:pi'.*not callable"):
        resolve_reward("math:pi")


def _flaky(prompt, response, sample):
    if response == "raise":
        return 1 / 0
    return {"ok": 1.0, "nan": float("nan"), "str": "1.0"}[response]


def test_score_group_fail_names_reward_prompt_and_sample():
    with pytest.raises(RewardError) as e:
        score_group(_flaky, name="flaky", prompt="q", responses=["ok", "raise"], sample={}, prompt_index=7,
                    on_error="fail")
    msg = str(e.value)
    assert "'flaky'" in msg and "prompt 7" in msg and "sample 1" in msg and "ZeroDivisionError" in msg
    with pytest.raises(RewardError, match="sample 0.*non-finite"):
        score_group(_flaky, name="flaky", prompt="q", responses=["nan"], sample={}, prompt_index=0,
                    on_error="fail")
    with pytest.raises(RewardError, match="sample 0.*str"):
        score_group(_flaky, name="flaky", prompt="q", responses=["str"], sample={}, prompt_index=0,
                    on_error="fail")


def test_score_group_zero_counts_failures():
    scores, failures = score_group(_flaky, name="flaky", prompt="q", responses=["ok", "raise", "nan", "str", "ok"],
                                   sample={}, prompt_index=0, on_error="zero")
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert failures == 3
    with pytest.raises(ValueError, match="on_error"):
        score_group(_flaky, name="flaky", prompt="q", responses=[], sample={}, prompt_index=0, on_error="skip")


def test_score_group_with_math_verify():
    scores, failures = score_group(math_verify, name="math_verify", prompt="q", responses=["\\boxed{3}", "4"],
                                   sample={"answer": "3"}, prompt_index=0, on_error="fail")
    assert (scores, failures) == ([1.0, 0.0], 0)


@pytest.mark.parametrize("on_error", ["fail", "zero"])
def test_a_reward_past_its_timeout_is_named_or_counted(on_error):
    import time

    from tests.rewards import hang

    calls = []

    def sometimes_hangs(prompt, response, sample):
        calls.append(response)
        return hang(prompt, response, sample) if response == "b" else 1.0

    t0 = time.monotonic()
    if on_error == "fail":
        with pytest.raises(RewardError, match=r"reward 'slow' timed out after 0.5 s on prompt 3, sample 1"):
            score_group(sometimes_hangs, name="slow", prompt="p", responses=["a", "b", "c"], sample={},
                        prompt_index=3, on_error=on_error, timeout_s=0.5)
    else:
        scores, failed = score_group(sometimes_hangs, name="slow", prompt="p", responses=["a", "b", "c"], sample={},
                                     prompt_index=3, on_error=on_error, timeout_s=0.5)
        assert scores == [1.0, 0.0, 1.0] and failed == 1 and calls == ["a", "b", "c"]  # the next call still runs
    assert time.monotonic() - t0 < 5
