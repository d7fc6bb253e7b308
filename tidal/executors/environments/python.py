"""The `python` environment: the model may run Python code before it answers.

Each call runs in a fresh interpreter (a subprocess), so nothing leaks between calls or samples:

- a wall-time limit (default 5 s): the child is the leader of its own session, and on timeout the
  whole process group is killed, children it spawned included;
- a memory limit (default 512 MiB of address space, RLIMIT_AS) and a CPU-time backstop, set by the
  child itself before the code runs rather than in `preexec_fn`, which is unsafe when the rollout
  steps environments from several threads;
- a fresh, empty temporary directory as its cwd and $HOME, deleted afterwards;
- an environment built from scratch (no proxies, credentials or CUDA settings of the trainer);
- stdout and stderr merged, in order, into an unnamed temporary file whose size the child cannot
  grow past a cap (RLIMIT_FSIZE), so a print loop cannot fill the trainer's memory; the observation
  keeps the head and tail of it (default 2000 characters) around a "...[truncated]..." marker.

No network: where the process may make one (root, or unprivileged user namespaces), the child
first enters a fresh network namespace of its own (unshare(2): no interface but a loopback that is
down), which holds for everything it runs: ctypes, subprocesses, other programs. `Python.isolation()`
says which applies (`--dry-run` prints it); once a namespace could be made, a call that cannot make
one fails rather than run without it. Elsewhere it is BEST EFFORT only: the bootstrap replaces
`socket.socket` (and `_socket.socket`) with a class that refuses to be created, which stops ordinary
code (socket, urllib, requests) but not code determined to get out. The socket block applies in the
namespace too. Run untrusted models in a sandboxed container.

Deterministic for deterministic code: PYTHONHASHSEED is fixed (set iteration order), and tracebacks
name the code `<code>`, never the temporary paths. That is why the interpreter runs with `-s` (no
user site) and a from-scratch environment rather than `-I`, whose `-E` would ignore PYTHONHASHSEED.
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile

from tidal.executors.environments.base import ENVS
from tidal.executors.environments.toolcall import ToolCall, ToolEnv, tool_schema

TRUNCATED = "...[truncated]..."

NAMESPACE, BEST_EFFORT = "network namespace", "best effort (socket blocked)"

# Run in the child first: a network namespace of its own, plain (root) or inside a user namespace
# mapping the same uid/gid (unprivileged); prints which, or exits 3 when argv[1] is "required" and
# neither can be made.
_NETNS = r"""
import ctypes, os, sys
_libc = ctypes.CDLL(None, use_errno=True)
_NEWNET, _NEWUSER = 0x40000000, 0x10000000
def _netns():
    if _libc.unshare(_NEWNET) == 0:
        return True
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(_NEWUSER | _NEWNET) != 0:
        return False
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w") as f:
            f.write(text)
    return True
if sys.argv[1] != "off":
    _isolated = _netns()
    if sys.argv[1] == "probe":
        print("yes" if _isolated else "no")
        sys.exit(0)
    if not _isolated:
        print("error: could not enter a network namespace: " + os.strerror(ctypes.get_errno()))
        sys.exit(3)
del ctypes, os, _libc, _netns, _NEWNET, _NEWUSER
sys.argv = sys.argv[1:]
"""

# Run in the child by `python -c`: the namespace, limits, the socket block, then the code (read from
# stdin) as __main__. argv: namespace (required / off), memory bytes, output bytes, cpu seconds.
_BOOTSTRAP = _NETNS + r"""
import linecache, resource, sys, traceback
_as, _fsize, _cpu = (int(a) for a in sys.argv[1:4])
for _limit, _value in ((resource.RLIMIT_AS, _as), (resource.RLIMIT_FSIZE, _fsize), (resource.RLIMIT_CPU, _cpu)):
    if _value > 0:
        resource.setrlimit(_limit, (_value, _value))
import socket, _socket
class _NoNetwork:
    def __init__(self, *args, **kwargs):
        raise OSError("network access is disabled in this sandbox")
socket.socket = _socket.socket = _NoNetwork
_source = sys.stdin.read()
sys.argv = ["<code>"]
linecache.cache["<code>"] = (len(_source), None, _source.splitlines(True), "<code>")
_globals = {"__name__": "__main__", "__builtins__": __builtins__}
del linecache, resource, socket, _socket, _NoNetwork, _limit, _value, _as, _fsize, _cpu
try:
    exec(compile(_source, "<code>", "exec"), _globals)
except SystemExit:
    raise
except BaseException as _exc:
    # drop the bootstrap's own frame: the model should see its code only
    traceback.print_exception(type(_exc), _exc, _exc.__traceback__.tb_next)
    sys.exit(1)
"""


class Python(ToolEnv):
    """Answers `python` tool calls by running the code in a limited subprocess (see the module doc)."""

    deterministic = True  # for deterministic code; code that reads the clock or randomness is not
    TOOLS = [tool_schema("python", "Run Python code in a fresh interpreter and return what it prints "
                         "(stdout and stderr).", {"code": "the Python source to run"})]

    def __init__(self, sample: dict | None = None, *, tokenizer=None, max_calls: int = 8,
                 timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000,
                 site_packages: bool = True) -> None:
        super().__init__(sample, tokenizer=tokenizer, max_calls=max_calls)
        if timeout_s <= 0 or memory_mb <= 0 or max_output_chars <= 0:
            raise ValueError("timeout_s, memory_mb and max_output_chars must be positive")
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.site_packages = site_packages  # False: `-S`, the standard library only

    @staticmethod
    @functools.cache
    def isolation() -> str:
        """NAMESPACE where a child of this process can enter a network namespace, else BEST_EFFORT
        (probed once a process: a child tries)."""
        probe = subprocess.run([sys.executable, "-s", "-S", "-c", _NETNS, "probe"], capture_output=True,
                               text=True, env=_child_env("/"), timeout=30)
        return NAMESPACE if probe.stdout.strip() == "yes" else BEST_EFFORT

    def call(self, call: ToolCall) -> str:
        return self.run(call.text_argument("code"))

    def run(self, code: str) -> str:
        """The observation for running `code`: its output, or an error line followed by the output."""
        with tempfile.TemporaryDirectory(prefix="tidal-python-", ignore_cleanup_errors=True) as cwd, tempfile.TemporaryFile() as out:
            timed_out, returncode = self._execute(code, cwd, out)
            out.seek(0)
            output = _truncate(out.read().decode("utf-8", errors="replace"), self.max_output_chars)
        if timed_out:
            return _join(f"error: timed out after {self.timeout_s:g} s", output)
        if returncode == 0:
            return output
        if returncode < 0:
            return _join(f"error: killed by signal {_signal_name(-returncode)}", output)
        return _join(f"error: exit code {returncode}", output)

    def _execute(self, code: str, cwd: str, out) -> tuple[bool, int]:
        proc = subprocess.Popen(self._command(), cwd=cwd, env=_child_env(cwd), stdin=subprocess.PIPE,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.communicate(code.encode("utf-8", errors="replace"), timeout=self.timeout_s)
            return False, proc.returncode
        except subprocess.TimeoutExpired:
            return True, -signal.SIGKILL
        finally:
            _kill_group(proc)  # on timeout, and also any children the code left running

    def _command(self) -> list[str]:
        # the output cap is in bytes; 4 bytes a character covers UTF-8, and the slack shows the tail
        output_bytes = max(64 * 1024, 8 * self.max_output_chars)
        cpu_s = int(self.timeout_s) + 2  # a backstop only: the wall-time limit is the one that acts
        flags = ["-s", "-u"] + ([] if self.site_packages else ["-S"])
        namespace = "required" if self.isolation() == NAMESPACE else "off"
        return [sys.executable, *flags, "-c", _BOOTSTRAP, namespace,
                str(self.memory_mb * 1024 * 1024), str(output_bytes), str(cpu_s)]


def _child_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
            # one thread each: BLAS pools reserve address space per thread, past a small RLIMIT_AS
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its session, so its group id is its pid
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone
    proc.wait()


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    # head and tail: the tail holds the traceback when there is one
    head = limit // 2
    return text[:head] + TRUNCATED + text[len(text) - (limit - head):]


def _join(error: str, output: str) -> str:
    return f"{error}\n{output}" if output else error


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


ENVS.register("python", Python)
