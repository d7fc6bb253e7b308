"""TensorBoard event files of the metrics rows (`logging.tensorboard`), written by rank 0's metrics
thread: every number of a row as a scalar at its step, tagged by the executor that reported it."""
from __future__ import annotations

from pathlib import Path


class TensorBoardLog:
    def __init__(self, log_dir: Path, *, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        # a resumed run redoes the steps from first_step: purge what an earlier attempt wrote past it
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=first_step if first_step > 0 else None)

    def write(self, row: dict, *, tags: dict[str, str]) -> None:
        """tags: row key -> tag (e.g. loss -> trainer/loss); keys without one keep their name."""
        for key, value in row.items():
            # wall-clock stamps (gen_start_t, push_end_t, ...) are not curves
            if key == "step" or key.endswith("_t") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self.writer.add_scalar(tags.get(key, key), value, global_step=row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def tags_of(records: dict[str, dict], derived: dict) -> dict[str, str]:
    """trainer/loss, generator/gen_s, ..., time/<executor>_s, step/<derived>; eval/* as they are."""
    tags = {f"{name}_s": f"time/{name}_s" for name in records}
    tags.update({k: f"step/{k}" for k in derived})
    for name, record in records.items():
        tags.update({k: k if "/" in k else f"{name}/{k}" for k in record})
    return tags
