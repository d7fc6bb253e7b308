"""Rule rewards: math_simple (math_verify: test_math_verify.py), reward resolution, and how reward
failures are reported."""

import pytest

from tidal.executors.reward.functions import (
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
    from tests.rewards import boom

    assert resolve_reward("math_verify") is math_verify
    assert resolve_reward("tests.rewards:boom") is boom
    assert "math_verify" in REWARDS.names()
    with pytest.raises(ValueError, match="unknown reward .nope.; known: embedded, embedded_lookup, env, math_simple, math_verify"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="'no_such_module_xyz:f'.*cannot import"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="'math:nope'.*no attribute 'nope'"):
        resolve_reward("math:nope")
    with pytest.raises(ValueError, match="'math:pi'.*not callable"):
        resolve_reward("math:pi")


def _user_module(tmp_path, monkeypatch, name: str, source: str) -> str:
    """A module `name` written to a directory put on sys.path, as a user's reward file would be."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_module_not_on_the_path_gets_a_pythonpath_hint(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"^reward 'no_such_module_xyz:f': cannot import module 'no_such_module_xyz'"
                                         r": No module named 'no_such_module_xyz' \(is its directory on PYTHONPATH\? "
                                         r"e\.g\. PYTHONPATH=/path/to/dir python launch\.py \.\.\.\)$"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match=r"PYTHONPATH"):  # its package is missing: the same hint
        resolve_reward("no_such_pkg_xyz.rewards:f")
    # the module is found but one of its own imports is not: a missing dependency, not a path problem
    name = _user_module(tmp_path, monkeypatch, "tidal_reward_needs_dep",
                        "import no_such_dependency_xyz\ndef score(prompt, response, sample):\n    return 1.0\n")
    with pytest.raises(ValueError) as e:
        resolve_reward(f"{name}:score")
    assert "No module named 'no_such_dependency_xyz'" in str(e.value) and "PYTHONPATH" not in str(e.value)


def test_a_reward_that_cannot_take_three_arguments_is_refused_at_resolution(tmp_path, monkeypatch):
    name = _user_module(tmp_path, monkeypatch, "tidal_reward_signatures", """
def two(prompt, response):
    return 1.0
def needs_key(prompt, response, sample, *, weight):
    return weight
def four(prompt, response, sample, extra):
    return 1.0
def varargs(*args):
    return 1.0
def defaults(prompt, response, sample=None, scale=1.0):
    return scale
class Scorer:
    def __call__(self, prompt, response, sample):
        return 1.0
scorer = Scorer()
""")
    for attr, signature in [("two", "(prompt, response)"), ("needs_key", "(prompt, response, sample, *, weight)"),
                            ("four", "(prompt, response, sample, extra)"), ("math:floor", "(x, /)")]:
        spec = attr if ":" in attr else f"{name}:{attr}"
        with pytest.raises(ValueError) as e:
            resolve_reward(spec)
        assert str(e.value) == (f"reward {spec!r}: its signature {signature} cannot take the 3 positional "
                                f"arguments (prompt, response, sample) a reward is called with")
    for attr in ("varargs", "defaults", "scorer"):
        assert resolve_reward(f"{name}:{attr}")("p", "r", {}) == 1.0


def _flaky(prompt, response, sample):
    if response == "raise":
        return 1 / 0
    return {"ok": 1.0, "nan": float("nan"), "str": "1.0"}[response]


def test_errors_name_the_data_row_and_its_id_column():
    def fail(**where):
        with pytest.raises(RewardError) as e:
            score_group(_flaky, name="he", prompt="q", responses=["ok", "ok", "raise"], on_error="fail", **where)
        return str(e.value)

    assert fail(sample={"task_id": "HumanEval/16", "answer": "x"}, prompt_index=2, data_row=17) == (
        "reward 'he' failed on data row 17 (task_id HumanEval/16), sample 2: ZeroDivisionError: division by zero")
    # `id` comes first of the id columns; a row without one is named by its line alone
    assert "on data row 3 (id 7), sample 2" in fail(sample={"problem_id": 1, "id": 7}, prompt_index=0, data_row=3)
    assert "on data row 3, sample 2" in fail(sample={"answer": "1"}, prompt_index=0, data_row=3)
    # the embedded task has no data file: its prompts are named by their index in the step
    assert "on prompt 5, sample 2" in fail(sample={"task_id": "t"}, prompt_index=5, data_row=None)
    scores, errors = score_group(_flaky, name="he", prompt="q", responses=["raise", "ok"], sample={"uid": "u9"},
                                 prompt_index=0, data_row=4, on_error="zero")
    assert scores == [0.0, 1.0]
    assert errors == {0: "reward 'he' failed on data row 4 (uid u9), sample 0: ZeroDivisionError: division by zero"}


def test_data_rows_know_their_line(tmp_path):
    from tidal.executors.data import load_prompts

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "task_id": "T/0"}\n\n{"prompt": "b", "task_id": "T/1"}\n')
    assert [(r.prompt, r.line) for r in load_prompts(str(path))] == [("a", 1), ("b", 3)]  # blank lines count


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
    scores, errors = score_group(_flaky, name="flaky", prompt="q", responses=["ok", "raise", "nan", "str", "ok"],
                                 sample={}, prompt_index=0, on_error="zero")
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert sorted(errors) == [1, 2, 3]
    assert errors[2] == "reward 'flaky' failed on prompt 0, sample 2: ValueError: returned non-finite nan"
    with pytest.raises(ValueError, match="on_error"):
        score_group(_flaky, name="flaky", prompt="q", responses=[], sample={}, prompt_index=0, on_error="skip")


def test_score_group_with_math_verify():
    scores, errors = score_group(math_verify, name="math_verify", prompt="q", responses=["\\boxed{3}", "4"],
                                 sample={"answer": "3"}, prompt_index=0, on_error="fail")
    assert (scores, errors) == ([1.0, 0.0], {})


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
        assert scores == [1.0, 0.0, 1.0] and list(failed) == [1] and calls == ["a", "b", "c"]  # the next call still runs
        assert failed[1] == "reward 'slow' timed out after 0.5 s on prompt 3, sample 1"
    assert time.monotonic() - t0 < 5
