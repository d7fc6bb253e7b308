"""math_verify (Hugging Face's math-verify) vs math_simple (the hand-written verifier): verdicts on the
frozen answer pairs of tests/test_math_verify.py and the time per call: a pair's first call (new text:
what a reward pays for a fresh response) and the median of REPEATS more (math-verify caches parsed
text). math-verify's very first call also imports sympy and its LaTeX parser: timed apart.

    .venv/bin/python bench/math_verify_agreement.py
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate  # noqa: E402

from executors.reward.functions import math_simple, math_verify  # noqa: E402
from tests.test_math_verify import AGREEMENT  # noqa: E402

REPEATS = 20


def per_call_s(fn, response: str, gold: str) -> tuple[float, float]:
    """(the first call, the median of the repeats)"""
    t0 = time.perf_counter()
    fn("q", response, {"answer": gold})
    first = time.perf_counter() - t0
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn("q", response, {"answer": gold})
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def main() -> None:
    t0 = time.perf_counter()
    math_verify("q", "\\boxed{1}", {"answer": "1"})
    first_s = time.perf_counter() - t0
    rows, simple_s, verify_s = [], [], []
    for what, response, gold, _, _ in AGREEMENT:
        s, v = math_simple("q", response, {"answer": gold}), math_verify("q", response, {"answer": gold})
        simple_s.append(per_call_s(math_simple, response, gold))
        verify_s.append(per_call_s(math_verify, response, gold))
        rows.append([what, response[:40], gold[:20], int(s), int(v), "" if s == v else "differ",
                     f"{simple_s[-1][0] * 1e3:.3f}", f"{verify_s[-1][0] * 1e3:.2f}", f"{verify_s[-1][1] * 1e3:.2f}"])
    print(tabulate(rows, headers=["pair", "response", "gold", "simple", "verify", "", "simple ms",
                                  "verify ms (new)", "verify ms (cached)"]))
    agree = sum(r[3] == r[4] for r in rows)
    ms, mv = (statistics.median(t[0] for t in times) for times in (simple_s, verify_s))
    print(f"\nagree on {agree} of {len(rows)} pairs; median first call per pair: math_simple {ms * 1e3:.3f} ms, "
          f"math_verify {mv * 1e3:.2f} ms ({mv / ms:.0f}x); math_verify's very first call {first_s:.2f} s (imports)")


if __name__ == "__main__":
    main()
