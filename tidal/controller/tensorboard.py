"""TensorBoard event files of the metrics rows (`logging.tensorboard`), written by rank 0's metrics
thread: every number of a row as a scalar at its step, tagged by the executor that reported it
(the row's namespaced keys)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping


class TensorBoardLog:
    def __init__(self, log_dir: Path, *, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        # a resumed run redoes the steps from first_step: purge what an earlier attempt wrote past it
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=first_step if first_step > 0 else None)

    def write(self, row: dict, *, tags: Mapping[str, str]) -> None:
        for tag, value in scalars(row, tags).items():
            self.writer.add_scalar(tag, value, global_step=row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def scalars(row: Mapping[str, object], tags: Mapping[str, str]) -> dict[str, float]:
    """tag -> value of a row's numbers; tags: row key -> tag (tags_of), keys without one are not written, nor are
    wall-clock stamps (gen_start_t, push_end_t, ...: not curves)."""
    return {tags[key]: value for key, value in row.items()
            if key in tags and not key.endswith("_t") and not isinstance(value, bool) and isinstance(value, (int, float))}


def tags_of(row: Mapping[str, object], *, executors: Iterable[str], derived: Mapping[str, object]) -> dict[str, str]:
    """row key -> tag: the namespaced keys as they are (trainer/loss, generator/gen_s, eval/pass@1),
    time/<executor>_s, step/<derived>."""
    tags = {k: k for k in row if "/" in k}
    tags.update({f"{name}_s": f"time/{name}_s" for name in executors})
    tags.update({k: f"step/{k}" for k in derived})
    return tags
