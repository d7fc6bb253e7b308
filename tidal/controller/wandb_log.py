"""A Weights & Biases run of the metrics rows (`logging.wandb`), written by rank 0 beside metrics.jsonl: the
run's config, every number of a row at its step under the TensorBoard tags (trainer/loss, time/generator_s),
and at the end metrics.png, timeline.png and the samples of samples.jsonl as a table.

Offline where it cannot reach W&B: `mode="auto"` goes online only with credentials (WANDB_API_KEY or a
`wandb login` netrc entry) and honours WANDB_MODE; an offline run lands in <output_dir>/wandb, and `wandb sync`
uploads it later. The first line says which. A resumed run continues the same W&B run (its id is kept in
<output_dir>/wandb/run_id); W&B's steps only increase, so steps an interrupted attempt logged past its
checkpoint keep that attempt's values there (metrics.jsonl holds the redone ones)."""
from __future__ import annotations

import json
import netrc
import os
import secrets
import sys
from pathlib import Path
from typing import Mapping

from tidal.controller.tensorboard import scalars

SAMPLE_COLUMNS = ("step", "prompt_index", "sample", "prompt", "response", "reward", "advantage", "length", "finished")


def _mode(mode: str) -> tuple[str, str]:
    """(online/offline/disabled, why)."""
    if mode != "auto":
        return mode, f"logging.wandb_mode={mode}"
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], f"WANDB_MODE={os.environ['WANDB_MODE']}"
    if os.environ.get("WANDB_API_KEY"):
        return "online", "WANDB_API_KEY is set"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online", "logged in (netrc)"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline", "no WANDB_API_KEY or `wandb login`"


class WandbLog:
    def __init__(self, output_dir: Path, *, first_step: int, project: str, name: str | None, mode: str,
                 config: Mapping):
        import wandb  # the optional extra: pip install 'tidal[wandb]'

        self.output_dir, root = output_dir, output_dir / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "run_id"
        run_id = id_file.read_text().strip() if first_step > 0 and id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        mode, why = _mode(mode)
        self.run = wandb.init(project=project, name=name or output_dir.name, id=run_id, resume="allow",
                              dir=str(output_dir), mode=mode, config=dict(config),
                              settings=wandb.Settings(console="off", silent=True))
        where = (f"offline ({why}) in {root}; `wandb sync {root}/offline-run-*` uploads it" if mode == "offline"
                 else f"{mode} ({why})" + (f": {self.run.url}" if getattr(self.run, "url", None) else ""))
        print(f"tidal: W&B run {run_id} {where}", file=sys.stderr, flush=True)

    def write(self, row: dict, *, tags: Mapping[str, str]) -> None:
        self.run.log(scalars(row, tags), step=row["step"])

    def close(self) -> None:
        """The run's plots and samples, then the end of the W&B run."""
        import wandb

        extras = {f"plots/{png.stem}": wandb.Image(str(png)) for png in
                  (self.output_dir / "metrics.png", self.output_dir / "timeline.png") if png.is_file()}
        samples = self.output_dir / "samples.jsonl"
        if samples.is_file():
            rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
            extras["samples"] = wandb.Table(columns=list(SAMPLE_COLUMNS),
                                            data=[[r.get(c) for c in SAMPLE_COLUMNS] for r in rows])
        if extras:
            self.run.log(extras)
        self.run.finish()
