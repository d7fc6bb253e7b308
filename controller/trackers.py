"""TensorBoard event files beside metrics.jsonl (logging.tensorboard), written by rank 0's metrics thread.

Tags group a row's fields by where they came from: `<executor>/<field>` for an executor's record
(trainer/loss, generator/gen_s), `time/<executor>_s` for the controller's wall time of each
executor's step, keys that already name a group as they are (eval/pass@1), and `step/<key>` for
what the recipe derives from several records (step/tpspd).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping


def scalars(row: Mapping[str, object], *, records: Mapping[str, Mapping[str, object]]) -> list[tuple[str, float]]:
    """(tag, value) of every numeric field of a row but its step. `records`: each executor's record
    the row was merged from. None (a non-finite value) and text (a digest) are left out."""
    # the row merged the records in order, so a key two executors post is the last one's
    owner = {key: name for name, record in records.items() for key in record}
    return [(_tag(key, owner=owner.get(key), executors=records.keys()), float(value))
            for key, value in row.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)]


def _tag(key: str, *, owner: str | None, executors) -> str:
    if "/" in key:
        return key
    if owner is not None:
        return f"{owner}/{key}"
    if key.endswith("_s") and key[:-2] in executors:
        return f"time/{key}"
    return f"step/{key}"


class TensorBoardTracker:
    """One SummaryWriter for one attempt of a run; a context manager that closes (flushes) it."""

    def __init__(self, *, log_dir: Path, first_step: int):
        """first_step: this attempt's first step. TensorBoard drops every event of an earlier attempt
        at that step or later (purge_step), so the steps a resumed run redoes appear once."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("logging.tensorboard=true needs the tensorboard package "
                              "(pip install tensorboard==2.21.0)") from exc
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=first_step)

    def log(self, *, step: int, row: Mapping[str, object], records: Mapping[str, Mapping[str, object]]) -> None:
        for tag, value in scalars(row, records=records):
            self._writer.add_scalar(tag, value, global_step=step)
        # each step on disk as it lands: a live TensorBoard shows it, and a killed job keeps it
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> "TensorBoardTracker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
