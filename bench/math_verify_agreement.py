"""math_verify (Hugging Face's math-verify) vs math_simple (the hand-written verifier): verdicts on the
frozen answer pairs of tests/math_verify_pairs.jsonl (tests/test_math_verify.py) and the median time
per call over REPEATS calls. math-verify keeps the last 20 parsed LaTeX and plain texts in caches, so
it is timed twice: with its caches cleared before each call (a fresh response, what a reward pays)
and warm (the same text again). Its very first call also imports sympy and the ANTLR LaTeX parser:
timed apart.

    .venv/bin/python bench/math_verify_agreement.py
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate  # noqa: E402

from tidal.executors.reward.functions import math_simple, math_verify  # noqa: E402

PAIRS = Path(__file__).resolve().parents[1] / "tests" / "math_verify_pairs.jsonl"
REPEATS = 20


def _clear_math_verify_caches() -> None:
    from math_verify import parser  # math-verify's own module; its caches are lru_caches

    parser.parse_latex_cached.cache_clear()
    parser.parse_expr_cached.cache_clear()


def median_call_s(fn, response: str, gold: str, before=None) -> float:
    """Median seconds of one fn call over REPEATS; `before` runs untimed ahead of each call."""
    times = []
    for _ in range(REPEATS):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn("q", response, {"answer": gold})
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _verdict(right) -> str:
    return "?" if right is None else str(right)


def main() -> None:
    t0 = time.perf_counter()
    math_verify("q", "\\boxed{1}", {"answer": "1"})
    first_s = time.perf_counter() - t0
    rows, simple_s, fresh_s, warm_s = [], [], [], []
    for pair in map(json.loads, PAIRS.read_text().splitlines()):
        response, gold = pair["response"], pair["gold"]
        s, v = math_simple("q", response, {"answer": gold}), math_verify("q", response, {"answer": gold})
        simple_s.append(median_call_s(math_simple, response, gold))
        fresh_s.append(median_call_s(math_verify, response, gold, before=_clear_math_verify_caches))
        warm_s.append(median_call_s(math_verify, response, gold))
        rows.append([pair["what"], response.replace("\n", " ")[:36], gold[:18], int(s), int(v),
                     _verdict(pair["right"]), "" if s == v else "differ", f"{simple_s[-1] * 1e6:.0f}",
                     f"{fresh_s[-1] * 1e3:.2f}", f"{warm_s[-1] * 1e3:.2f}"])
    print(tabulate(rows, headers=["pair", "response", "gold", "simple", "verify", "right", "", "simple µs",
                                  "verify ms", "verify ms (warm)"]))
    agree = sum(r[3] == r[4] for r in rows)
    ms, mf, mw = (statistics.median(t) for t in (simple_s, fresh_s, warm_s))
    print(f"\nagree on {agree} of {len(rows)} pairs. Median over pairs of the per-call median: math_simple "
          f"{ms * 1e6:.0f} µs, math_verify {mf * 1e3:.2f} ms ({mf / ms:.0f}x; warm caches {mw * 1e3:.2f} ms); "
          f"range math_simple {min(simple_s) * 1e6:.0f}-{max(simple_s) * 1e6:.0f} µs, math_verify "
          f"{min(fresh_s) * 1e3:.2f}-{max(fresh_s) * 1e3:.2f} ms. math_verify's very first call "
          f"{first_s:.2f} s (imports).")


if __name__ == "__main__":
    main()
