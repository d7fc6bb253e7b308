"""`python launch.py ...` without torchrun: start the job's ranks on this machine.

torch's own launcher runs in this process, so the workers are exactly what `torchrun` would start
(same environment, same elastic restarts). What it adds is taken away: its agent's log lines and
the ChildFailedError block after a failed worker. The workers print their own `tidal:`/`error:`
line; this process only hands on the exit code (128 + N for a signal N, as a shell does).
"""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path

# the loggers of torch's launcher and agent: every step at INFO/WARNING, the failure block at ERROR
TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")


def under_launcher() -> bool:
    """Started by torchrun (or by launch_here): the ranks run the job; otherwise this process starts them."""
    return "RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def launch_here(argv: list[str], *, nproc: int, max_restarts: int, roles: dict[int, str] | None = None,
                stop_timeout_s: int = 300) -> int:
    """Run `launch.py argv` on `nproc` local ranks; the exit code of the job: a rank killed by a signal's
    (128 + N), else its first failed rank's. roles: global rank -> executor name, for the message.
    stop_timeout_s: how long the agent waits for the ranks to stop (checkpoint first) after a signal
    before it kills them (torchrun's --shutdown-timeout, 30 s by default; torch < 2.13 has no such
    option and always waits 30 s)."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for name in TORCH_LOGGERS:  # a handler that drops all, and no propagation to the root's stderr
        logger = logging.getLogger(name)
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
    # the ranks print it in their resume line: the command that started them, not torchrun's
    os.environ["TIDAL_LAUNCHER"] = launcher_command(max_restarts=max_restarts)
    who = ", ".join(f"{name} {_span(ranks)}" for name, ranks in _by_executor(roles or {}).items())
    ranks = f"{nproc} rank" + ("s" if nproc != 1 else "")
    print(f"tidal: starting {ranks} on this machine" + (f" ({who})" if who else ""), file=sys.stderr, flush=True)
    # --standalone: a rendezvous on a free local port, so two jobs on one machine never collide
    grace = ["--shutdown-timeout", str(stop_timeout_s)]
    if not _knows(torchrun, grace[0]):
        grace = []
        print(f"tidal: torch {torch_version()}'s launcher has no --shutdown-timeout: a stop gives the ranks its "
              f"fixed 30 s to checkpoint, not stop_timeout_s={stop_timeout_s}", file=sys.stderr, flush=True)
    args = torchrun.parse_args(["--nproc-per-node", str(nproc), "--standalone", "--max-restarts", str(max_restarts),
                                *grace, *rank_program(), *argv])
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        rank, failure = cause(exc)
        if failure.exitcode < 0:  # killed by a signal: the rank could not say so itself
            role = f" ({roles[rank]})" if roles and rank in roles else ""
            print(f"tidal: rank {rank}{role} was killed by {failure.signal_name()}", file=sys.stderr, flush=True)
            return 128 - failure.exitcode
        return failure.exitcode
    except SignalException as exc:  # the agent stopped the ranks (they got the signal too) before raising
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:  # Ctrl-C before the agent installed its handlers
        return 130
    return 0


def _by_executor(roles: dict[int, str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rank in sorted(roles):
        out.setdefault(roles[rank], []).append(rank)
    return out


def _span(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def _knows(torchrun, option: str) -> bool:
    """Whether this torch's launcher takes `option` (torch 2.11's has no --shutdown-timeout)."""
    return option in torchrun.get_args_parser()._option_string_actions


# a rank's exit after a graceful stop (checkpoint saved, the resume line printed): 128 + SIGINT / SIGTERM
STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def cause(exc) -> tuple[int, object]:
    """The failed rank that caused a ChildFailedError.
    - A rank that stopped gracefully on a signal: once it exits, torch's agent sends SIGTERM to the
      ranks still finishing, and a rank killed that way is not a failure to report.
    - Else a rank killed by a signal: its peers only exit after it (their watchdog sees it die),
      but torch's first failure is the earliest by a whole-second timestamp, which picked a peer's
      echo (exit 17) in 3 of 4 kills of the trainer."""
    stopped = sorted(rank for rank, f in exc.failures.items() if f.exitcode in STOPPED)
    killed = sorted(rank for rank, f in exc.failures.items() if f.exitcode < 0)
    for ranks in (stopped, killed):
        if ranks:
            return ranks[0], exc.failures[ranks[0]]
    return exc.get_first_failure()


def rank_program() -> list[str]:
    """What each rank runs, as torchrun takes it: the launch.py the user started (a checkout's), else the
    package (`python -m tidal`: the `tidal` command, which an installed Tidal has without a launch.py)."""
    return [sys.argv[0]] if sys.argv[0].endswith("launch.py") else ["--module", "tidal"]


def launcher_command(*, max_restarts: int) -> str:
    """How the user started this job, to print in a resume command: `python launch.py`, `tidal` or
    `python -m tidal`, with `--max-restarts N`."""
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    if Path(sys.argv[0]).name == "tidal":  # the installed command
        return shlex.join(["tidal", *restarts])
    python = shutil.which("python")
    # not realpath: a venv's python links to the system's, which lacks the venv's packages
    same = python is not None and os.path.abspath(python) == os.path.abspath(sys.executable)
    program = [sys.argv[0]] if sys.argv[0].endswith("launch.py") else ["-m", "tidal"]
    return shlex.join([("python" if same else sys.executable), *program, *restarts])


def without_max_restarts(argv: list[str]) -> list[str]:
    """argv without --max-restarts (and its value): the ranks run under the launcher it configures.
    Any unambiguous prefix counts (argparse accepts `--max-r 2`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name, eq, _ = arg.partition("=")
        if len(name) >= 3 and "--max-restarts".startswith(name):
            skip = not eq
            continue
        out.append(arg)
    return out
