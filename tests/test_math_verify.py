"""The math_verify reward (Hugging Face's math-verify) against the hand-written math_simple: a frozen
agreement table over answer pairs, and math_verify's verdict where the right one is not in doubt.
`bench/math_verify_agreement.py` prints the same table with the time per call."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tidal.executors.reward.functions import REWARDS, math_simple, math_verify, score_group

# one pair a line: what, response, gold, each verifier's verdict as measured, and the right verdict
# (checked by hand; null where it is a convention: two boxed answers, a truncated box, pi vs 3.14159,
# 0.333333 vs 1/3). The file is shared with bench/math_verify_agreement.py.
PAIRS = [json.loads(line) for line in Path(__file__).with_name("math_verify_pairs.jsonl").read_text().splitlines()]


def _id(pair: dict) -> str:
    return f"{pair['what']}: {pair['response']!r} vs {pair['gold']!r}"


@pytest.mark.parametrize("pair", PAIRS, ids=_id)
def test_agreement_table(pair):
    sample = {"answer": pair["gold"]}
    assert math_simple("q", pair["response"], sample) == pair["math_simple"]
    assert math_verify("q", pair["response"], sample) == pair["math_verify"]
    if pair["right"] is not None:
        assert pair["math_verify"] == pair["right"]


def test_where_they_differ():
    """Which pairs the two disagree on is part of the frozen table: a new math-verify release that moves
    one shows here first. math_simple is right on none of them; the ambiguous ones are conventions."""
    differ = {p["what"] for p in PAIRS if p["math_simple"] != p["math_verify"]}
    assert len(PAIRS) == 47
    assert differ == {"rounded, 6 places", "percent vs fraction", "units", "units, gold", "degrees", "choice letter",
                      "set order", "set, bare gold", "sqrt forms", "symbolic", "two boxes", "truncated box, alone",
                      "scientific"}


def test_math_verify_in_the_reward_worker_thread():
    """reward.timeout_s runs rewards on a worker thread, where math-verify's SIGALRM timeouts would raise
    ("signal only works in main thread"): ours are off, and the call must score, not fail."""
    threads = []

    def recorded(prompt, response, sample):
        threads.append(threading.current_thread())
        return math_verify(prompt, response, sample)

    scores, failures = score_group(recorded, name="math_verify", prompt="q",
                                   responses=["\\boxed{\\frac{1}{2}}", "\\boxed{\\{2,1\\}}", "so 0.4"],
                                   sample={"answer": "0.5"}, prompt_index=0, on_error="fail", timeout_s=120)
    assert (scores, failures) == ([1.0, 0.0, 0.0], {})  # no sample failed
    assert threads and all(t is not threading.main_thread() for t in threads)


def test_a_bare_gold_is_read_as_latex():
    """Unwrapped, math-verify finds nothing in these golds (its extraction is made for free text)."""
    for gold, response in [("[1,2)", "\\boxed{[1,2)}"), ("{1,2}", "\\boxed{\\{2,1\\}}"),
                           ("\\sqrt{2}/2", "\\boxed{\\frac{1}{\\sqrt{2}}}"), ("\\$12", "It costs $12$."),
                           ("\\(\\frac{1}{2}\\)", "\\boxed{0.5}"), (3, "#### 3")]:
        assert math_verify("q", response, {"answer": gold}) == 1.0, gold


def test_both_are_registered_and_declare_their_column():
    assert REWARDS.get("math_verify") is math_verify and REWARDS.get("math_simple") is math_simple
    assert math_verify.columns == math_simple.columns == ("answer",)
    for fn in (math_verify, math_simple):
        with pytest.raises(ValueError, match=f"{fn.__name__} needs the data column 'answer'"):
            fn("q", "\\boxed{1}", {"solution": "1"})


@pytest.mark.parametrize("gold", ["", "  "])
def test_an_unreadable_gold_is_a_data_error(gold):
    """Not a 0: every sample of the prompt would score 0 and the run would not say why."""
    with pytest.raises(ValueError, match="cannot read the answer"):
        math_verify("q", "\\boxed{1}", {"answer": gold})
