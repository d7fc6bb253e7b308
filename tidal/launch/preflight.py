"""What a run reads and writes, checked before any rank starts: one line naming the field or file.

Cheap on purpose (files are read, no model is loaded): `python launch.py` runs these before it
starts the ranks, and every rank runs them again before it loads anything (under a plain torchrun
the ranks are the first to see the command line). A bad path then costs a second, not a start-up
and a traceback per rank.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from tidal.controller.checkpoint import complete_checkpoints, open_checkpoint, step_dir
from tidal.controller.devices import attempt
from tidal.recipes.checks import check_groups
from tidal.recipes.config import RunConfig

# What marks a directory as holding a run: a fresh start would delete it (tidal/launch/run.py RUN_OUTPUTS).
RUN_MARKERS = ("config.json", "metrics.jsonl", "checkpoints", "final")


def preflight(cfg: RunConfig, *, resume: str | None, overwrite: bool, writes: bool) -> None:
    """writes=False (--dry-run): only what the run reads; nothing is written, so the output dir may be anything."""
    check_groups(cfg)
    if cfg.data.path is not None:
        rows = check_data(cfg.data.path, cfg.data.columns)
        check_reward_columns(rows, cfg, field="data.path")
    if cfg.eval.every and cfg.eval.path is not None:
        rows = check_data(cfg.eval.path, cfg.data.columns, field="eval.path")
        check_reward_columns(rows, cfg, field="eval.path")
    if cfg.model.path is not None:
        from tidal.modeling.hf import check_model_dir  # transformers is imported already by the recipe's executors

        try:
            check_model_dir(cfg.model.path)
        except OSError as exc:  # an unreadable file: the check reads what the ranks would
            raise ValueError(f"model.path: cannot read {exc.filename}: {exc.strerror}") from None
        except ValueError as exc:
            raise ValueError(f"model.path: {exc}") from None
    if writes:
        check_output(cfg.output_dir, resume=resume, overwrite=overwrite, steps=cfg.steps)


def check_data(path: str, columns, *, field: str = "data.path") -> list:
    """The whole file parses (load_prompts names file and line); tokenizing is left to the generator.
    Returns its rows."""
    from tidal.executors.data import load_prompts

    if Path(path).is_dir():
        raise ValueError(f"{field}: {path} is a directory, not a prompt file")
    try:
        return load_prompts(path, columns)
    except UnicodeDecodeError as exc:  # a ValueError too, but one that names neither file nor line
        raise ValueError(f"{field}: {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # pyarrow's errors are ValueErrors too, some over several lines
        raise ValueError(f"{field}: {str(exc).strip().splitlines()[0]}") from None


def check_reward_columns(rows: list, cfg: RunConfig, *, field: str, first: int = 5) -> None:
    """The columns each reward declares it reads (`fn.columns`, e.g. math_verify's 'answer') are in
    the file's first rows, after data.prompt_key/answer_key: a missing one fails here, not after the
    first generation."""
    from tidal.executors.reward.functions import resolve_reward

    path = getattr(cfg.eval if field == "eval.path" else cfg.data, "path")
    for spec in cfg.reward_functions:
        for column in getattr(resolve_reward(spec), "columns", ()):
            for i, row in enumerate(rows[:first], start=1):
                if column not in row.extras:
                    hint = ("set data.answer_key to the column that holds the answer" if column == "answer"
                            else "add the column or choose another reward")
                    has = ", ".join(repr(k) for k in [cfg.data.prompt_key, *row.extras][:8])
                    raise ValueError(f"{field}: reward {spec!r} reads the column {column!r}, which row {i} of {path} "
                                     f"lacks (it has {has}); {hint}, or set reward.functions")


def check_output(output_dir: str | None, *, resume: str | None, overwrite: bool, steps: int) -> None:
    # the default is a new runs/<timestamp>: only its parents can be wrong
    out = Path(output_dir) if output_dir else Path("runs", "<timestamp>")
    check_writable(out)
    if output_dir is None:
        return
    if resume is not None:
        check_resume(out, resume, steps=steps)
    elif not overwrite and attempt() == 0:  # a restarted attempt continues the run its first attempt began
        held = [name for name in RUN_MARKERS if (out / name).exists()]
        if held:
            raise ValueError(f"output dir {out} already holds a run ({', '.join(held)}); pass --resume to "
                             f"continue it or --overwrite to replace it")


def check_writable(out: Path) -> None:
    """The output dir is a directory, or can be made one: its nearest existing parent is a writable directory."""
    try:
        if out.exists() and not out.is_dir():
            raise ValueError(f"output dir {out} is a file, not a directory")
        existing = next(p for p in (out, *out.parents) if p.exists())
    except OSError as exc:  # e.g. a parent that may not be searched
        raise ValueError(f"output dir {out}: cannot look at {exc.filename}: {exc.strerror}") from None
    if not existing.is_dir():
        raise ValueError(f"output dir {out}: {existing} is a file, not a directory")
    try:  # a real write, not os.access: root passes os.access where a read-only or special filesystem refuses
        tempfile.TemporaryDirectory(dir=existing, prefix=".tidal-probe-").cleanup()
    except OSError as exc:
        raise ValueError(f"output dir {out} is not writable ({exc.strerror})" if existing == out else
                         f"output dir {out} cannot be created: {existing} is not writable ({exc.strerror})") from None


def _whole(path: Path) -> bool:
    try:
        open_checkpoint(path, hashes=False)
        return True
    except (ValueError, OSError):
        return False


class RunComplete(Exception):
    """--resume of a run that has reached its steps: nothing to do (exit 0, nothing changed)."""


def check_resume(out: Path, resume: str, *, steps: int) -> None:
    """There is a checkpoint to continue from (sizes against its manifest; the ranks verify the hashes),
    and steps left to run after it."""
    if resume == "latest":
        found = complete_checkpoints(out)
        if not found:
            raise ValueError(f"--resume: {out} holds no complete checkpoint (checkpoints/step_*/manifest.json); "
                             f"start it again without --resume (add --overwrite)")
        try:  # sizes here, in a second; the ranks verify the hashes
            newest = open_checkpoint(found[-1], hashes=False)
        except ValueError as exc:  # the newest is damaged: never resumed from, but say which one is whole
            whole = next((p for p in reversed(found[:-1]) if _whole(p)), None)
            raise ValueError(f"--resume: {exc}" + (f"; the newest whole one before it is {whole}: pass --resume {whole}"
                                                   if whole else "")) from None
        check_steps_left(out, newest.step, steps=steps)
        return
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"--resume: no checkpoint directory at {path}")
    try:
        found = open_checkpoint(path, hashes=False)
    except OSError as exc:
        raise ValueError(f"--resume: checkpoint {path}: cannot read {exc.filename}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(f"--resume: {exc}") from None
    if found.step + 1 >= steps:
        raise ValueError(f"--resume: checkpoint {path} holds step {found.step}, the last of steps={steps}; "
                         f"raise --steps to train further")


def _last_logged_step(out: Path) -> int:
    """The last step in metrics.jsonl (-1 without one): how far a run got."""
    rows = [line for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (out / "metrics.jsonl").is_file() else []
    return max((json.loads(r)["step"] for r in rows), default=-1)


def check_steps_left(out: Path, step: int, *, steps: int) -> None:
    """A finished run (its last step is a checkpoint) says so and changes nothing; one that finished
    before runs ended in a checkpoint would redo steps and rewrite final/ silently: refused."""
    last = _last_logged_step(out)
    if (out / "final").is_dir() and last > step:
        raise ValueError(f"--resume: {out} finished at step {last} (final/), but its newest checkpoint is step {step}: "
                         f"resuming would redo steps {step + 1}-{last} and rewrite final/; to do that anyway pass "
                         f"--resume {step_dir(out, step)}")
    if step + 1 >= steps:
        raise RunComplete(f"{out} is complete: its checkpoint {step_dir(out, step)} holds step {step}, the last of "
                          f"steps={steps}; nothing to do (extend it with --resume --steps N, N > {steps})")
