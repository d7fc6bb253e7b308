"""The math_verify reward (Hugging Face's math-verify) against the hand-written math_simple: a frozen
agreement table over answer pairs, and math_verify's verdict where the right one is not in doubt.
`bench/math_verify_agreement.py` prints the same table with the time per call."""
from __future__ import annotations

import threading

import pytest

from executors.reward.functions import REWARDS, math_simple, math_verify

# (what, response, gold answer, math_simple's verdict, math_verify's verdict), as measured
AGREEMENT = [
    ('integer', 'so the answer is \\boxed{42}.', '42', 1, 1),
    ('integer', '\\boxed{41}', '42', 0, 0),
    ('integer, no box', 'We get 12 then 13', '13', 1, 1),
    ('integer, GSM8K', '#### 18', '18', 1, 1),
    ('negative', '\\boxed{-7}', '-7', 1, 1),
    ('decimal vs fraction', '\\boxed{\\frac{3}{4}}', '0.75', 1, 1),
    ('decimal vs fraction', '\\boxed{0.75}', '\\frac{3}{4}', 1, 1),
    ('dfrac', '\\boxed{\\dfrac{3}{4}}', '3/4', 1, 1),
    ('negative fraction', '\\boxed{-\\frac{1}{2}}', '-0.5', 1, 1),
    ('trailing zeros', '\\boxed{2.50}', '5/2', 1, 1),
    ('rounded', '\\boxed{0.333}', '1/3', 0, 0),
    ('thousands', 'The answer is 1,234.', '1234', 1, 1),
    ('thousands, boxed', '\\boxed{1,234}', '1234', 1, 1),
    ('percent', '\\boxed{50\\%}', '50', 1, 1),
    ('percent vs fraction', '\\boxed{50\\%}', '0.5', 0, 1),
    ('units', '\\boxed{5\\text{ cm}}', '5', 0, 1),
    ('dollars', '\\boxed{\\$12}', '12', 1, 1),
    ('equation', '\\boxed{x = 7}', '7', 1, 1),
    ('text choice', '\\boxed{\\text{B}}', 'b', 1, 1),
    ('text choice', '\\boxed{\\text{A}}', 'B', 0, 0),
    ('set order', '\\boxed{\\{1,2\\}}', '\\{2,1\\}', 0, 1),
    ('set vs missing element', '\\boxed{\\{1,2\\}}', '\\{1,2,3\\}', 0, 0),
    ('interval', '\\boxed{[1,2)}', '[1,2)', 1, 1),
    ('interval ends', '\\boxed{(1,2]}', '[1,2)', 0, 0),
    ('tuple', '\\boxed{(3, 4)}', '(3,4)', 1, 1),
    ('sqrt forms', '\\boxed{\\frac{\\sqrt{2}}{2}}', '\\sqrt{2}/2', 0, 1),
    ('sqrt forms', '\\boxed{\\frac{1}{\\sqrt{2}}}', '\\frac{\\sqrt{2}}{2}', 0, 1),
    ('pi', '\\boxed{2\\pi}', '2\\pi', 1, 1),
    ('pi vs decimal', '\\boxed{\\pi}', '3.14159', 0, 0),
    ('symbolic', '\\boxed{x^2+2x+1}', '(x+1)^2', 0, 1),
    ('two boxes', 'first \\boxed{1}, then corrected: \\boxed{2}', '2', 1, 0),
    ('truncated box', '\\boxed{5} and a truncated \\boxed{6', '5', 1, 1),
    ('no answer', 'I do not know.', '42', 0, 0),
    ('gold boxed', '\\boxed{9}', 'the answer is \\boxed{9}', 1, 1),
    ('inline math', 'The result is $\\frac{7}{2}$.', '3.5', 1, 1),
    ('scientific', '\\boxed{1.5 \\times 10^{3}}', '1500', 0, 1),
]
# where they differ, which is right: math_verify in all but one; "two boxes" is a convention (math-verify
# reads several boxed answers as one set {1, 2}; math_simple takes the last box, a corrected answer)
RIGHT = {"percent vs fraction": 1, "units": 1, "set order": 1, "sqrt forms": 1, "symbolic": 1, "scientific": 1,
         "two boxes": 1}


@pytest.mark.parametrize("what, response, gold, simple, verify", AGREEMENT)
def test_agreement_table(what, response, gold, simple, verify):
    assert math_simple("q", response, {"answer": gold}) == simple
    assert math_verify("q", response, {"answer": gold}) == verify
    if simple == verify:  # agreed verdicts are the right ones (checked by hand)
        return
    assert RIGHT[what] in (simple, verify)


def test_agreement_counts():
    differ = [a[0] for a in AGREEMENT if a[3] != a[4]]
    assert len(AGREEMENT) == 36 and len(differ) == 8
    assert [w for w in differ if RIGHT[w] != [a for a in AGREEMENT if a[0] == w][0][4]] == ["two boxes"]


def test_math_verify_runs_in_a_worker_thread():
    """Rewards run in a worker thread (reward.timeout_s): math-verify's signal timeouts must be off."""
    out = []
    worker = threading.Thread(target=lambda: out.append(math_verify("q", "\\boxed{\\frac{1}{2}}", {"answer": "0.5"})))
    worker.start()
    worker.join(timeout=120)
    assert out == [1.0]


def test_both_are_registered_and_declare_their_column():
    assert REWARDS.get("math_verify") is math_verify and REWARDS.get("math_simple") is math_simple
    assert math_verify.columns == math_simple.columns == ("answer",)
    with pytest.raises(ValueError, match="'answer'"):
        math_verify("q", "\\boxed{1}", {"solution": "1"})
