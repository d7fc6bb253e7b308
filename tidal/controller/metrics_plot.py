"""metrics.png: the run's curves at a glance, drawn by rank 0 at the end from metrics.jsonl (so a
resumed run draws all its steps). A panel whose keys no row has is left out."""
from __future__ import annotations

import math
from pathlib import Path

# panel title -> the row keys drawn in it
PANELS = {
    "reward": ("trainer/reward_mean", "eval/reward_mean"),
    "eval pass rate": ("eval/pass@1",),  # + eval/pass@k, added from the rows
    "response length (tokens)": ("trainer/response_len_mean", "eval/response_len_mean"),
    "loss": ("trainer/loss",),
    "critic: value loss": ("critic/value_loss",),  # PPO's critic
    "critic: explained variance": ("critic/explained_variance",),
    "KL to the reference": ("trainer/kl", "critic/reward_kl"),
    "entropy (nats)": ("trainer/entropy",),
    "grad norm (before clipping)": ("trainer/grad_norm",),
    "step time split (s)": ("step_s", "generator/gen_s", "trainer/train_s", "trainer/push_s", "eval_sampler/gen_s"),
    "staleness (policy versions)": ("trainer/staleness_mean", "trainer/staleness_max"),  # the offpolicy schedule's
}


# 0 in every row: the KL is off (beta = 0), or the schedule is on-policy: no panel to draw
OFF_WHEN_ZERO = {"trainer/kl", "critic/reward_kl", "trainer/staleness_mean", "trainer/staleness_max"}


def _panels(rows: list[dict]) -> dict[str, list[str]]:
    keys = {k for row in rows for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and (v or k not in OFF_WHEN_ZERO)}
    panels = {title: [k for k in wanted if k in keys] for title, wanted in PANELS.items()}
    panels["eval pass rate"] += sorted(k for k in keys if k.startswith("eval/pass@") and k != "eval/pass@1")
    return {title: ks for title, ks in panels.items() if ks}


def plot_metrics(rows: list[dict], path: Path) -> bool:
    """Write metrics.png; False (and nothing written) when no row has a key to draw."""
    panels = _panels(rows)
    if not panels:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    cols = 2
    nrows = math.ceil(len(panels) / cols)
    steps = (rows[0]["step"], rows[-1]["step"])  # every panel spans the run, evaluation-only ones too
    fig, axes = plt.subplots(nrows, cols, figsize=(11, 2.8 * nrows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels.items()):
        for key in keys:
            if key.startswith("eval/"):  # on evaluation steps only: points joined
                points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
                ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label=key)
            else:  # a None (a non-finite value) is a gap; the dots keep a lone value between gaps visible
                ax.plot([r["step"] for r in rows], [r[key] if r.get(key) is not None else math.nan for r in rows],
                        marker=".", markersize=3, label=key)
        ax.set_title(title, fontsize=10)
        ax.set_xlim(steps[0] - 0.5, steps[1] + 0.5)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
