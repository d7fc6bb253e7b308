"""Tool environments: the Hermes tool-call parser, the calculator and the Python sandbox."""
from __future__ import annotations

import os
import time

import pytest
import torch

from tidal.executors.environments.base import ModelTurn, env_class
from tidal.executors.environments.calculator import Calculator, CalculatorError, evaluate
from tidal.executors.environments.python import TRUNCATED, Python
from tidal.executors.environments.toolcall import MalformedCall, ToolCall, parse_tool_call, tool_schema


def turn(text: str, index: int = 0) -> ModelTurn:
    return ModelTurn(index=index, ids=torch.zeros(0, dtype=torch.int64), text=text, ended=True)


def call_text(name: str, **arguments) -> str:
    import json
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# --- parsing ----------------------------------------------------------------------------------------

def test_parse_good_call():
    call = parse_tool_call(call_text("calculator", expression="2+3"), ["calculator"])
    assert call == ToolCall("calculator", {"expression": "2+3"})


def test_parse_text_before_the_call_and_first_call_wins():
    text = "Let me compute.\n" + call_text("calculator", expression="1") + call_text("calculator", expression="2")
    assert parse_tool_call(text).arguments == {"expression": "1"}


def test_parse_arguments_as_json_string():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"4*5\\"}"}</tool_call>'
    assert parse_tool_call(text).arguments == {"expression": "4*5"}


def test_parse_raw_newlines_in_strings_are_accepted():
    text = '<tool_call>{"name": "python", "arguments": {"code": "x = 1\nprint(x)"}}</tool_call>'
    assert parse_tool_call(text).arguments["code"] == "x = 1\nprint(x)"


@pytest.mark.parametrize("text, message", [
    ('<tool_call>{"name": "calculator", "arguments": {</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "no closing </tool_call>"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'; tools: calculator"),
    ('<tool_call>["calculator"]</tool_call>', "JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', '"arguments" must be'),
    ('<tool_call>{"name": "calculator", "arguments": "{oops"}</tool_call>', '"arguments" is not valid JSON'),
])
def test_parse_malformed(text, message):
    with pytest.raises(MalformedCall, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_tool_call(text, ["calculator"])


def test_parse_no_call_is_a_final_answer():
    assert parse_tool_call("The answer is \\boxed{5}.", ["calculator"]) is None


@pytest.mark.parametrize("text, call", [
    # as Qwen2.5-Coder-0.5B-Instruct wrote its calls on HumanEval: no tags, alone or in a ```json fence
    ('{\n"name": "python",\n"arguments": {\n    "code": "print(1)"\n}\n}', ToolCall("python", {"code": "print(1)"})),
    ('```json\n{"name": "python", "arguments": {"code": "x"}}\n```', ToolCall("python", {"code": "x"})),
    ('The answer is {"name": "python", "arguments": {}}', None),  # text around it: an answer
    ('```python\nd = {"name": "python", "arguments": {}}\n```', None),  # code, not a call
    ('{"name": "python", "arguments": {}, "id": 3}', None),  # not exactly a call's two keys
    ('{"name": "python", "arguments": {', None),  # not JSON
])
def test_a_bare_call_without_tags_is_read_as_a_call(text, call):
    assert parse_tool_call(text, ["python"]) == call


def test_a_bare_call_of_an_unknown_tool_is_told_so():
    with pytest.raises(MalformedCall, match="unknown tool 'below_zero'; tools: python"):
        parse_tool_call('```json\n{"name": "below_zero", "arguments": {"operations": [1]}}\n```', ["python"])


def test_tool_schema_shape():
    schema = tool_schema("calculator", "Evaluate.", {"expression": "the expression", "n": {"type": "integer"}})
    assert schema == {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate.",
        "parameters": {"type": "object", "required": ["expression", "n"],
                       "properties": {"expression": {"type": "string", "description": "the expression"},
                                      "n": {"type": "integer"}}}}}


def test_registered_names():
    assert env_class("calculator") is Calculator
    assert env_class("python") is Python


# --- calculator -------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("2+3", 5), ("2+3*4", 14), ("(2+3)*4", 20), ("-3**2", -9), ("2**-1", 0.5), ("7/2", 3.5),
    ("7//2", 3), ("-7 % 3", 2), ("1.5e3 + 1", 1501.0), ("2**10", 1024),
])
def test_calculator_values(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("1/0", "division by zero"), ("5 % 0", "division by zero"), ("__import__('os')", "not allowed"),
    ("x + 1", "not allowed: the name 'x'"), ("(1).real", "not allowed"), ("[1][0]", "not allowed"),
    ("1 < 2", "not allowed"), ("True + 1", "not a number"), ("1j", "not a number"), ("2 +", "invalid syntax"),
    ("1" * 600, "longer than"), ("1e308 * 10", "too large"), ("(-8) ** 0.5", "not a real number"),
])
def test_calculator_errors(expression, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate(expression)


def test_calculator_huge_power_refused_quickly():
    start = time.monotonic()
    for expression in ("9**9**9", "2**(2**4096)", "(10**1000)**1000", "2.0**100000"):
        with pytest.raises(CalculatorError, match="too large"):
            evaluate(expression)
    assert time.monotonic() - start < 1.0


def test_calculator_episode():
    env = Calculator({"prompt": "What is 2+3?"})
    assert env.deterministic and env.reset() is None
    first = env.step(turn("I'll compute. " + call_text("calculator", expression="2+3")))
    assert (first.observation, first.done) == ("5", False)
    error = env.step(turn(call_text("calculator", expression="1/0"), 1))
    assert (error.observation, error.done) == ("error: division by zero", False)
    bad = env.step(turn("<tool_call>{not json</tool_call>", 2))
    assert bad.observation.startswith("error: tool call is not valid JSON") and not bad.done
    missing = env.step(turn(call_text("calculator", expr="1"), 3))
    assert "needs the argument 'expression'" in missing.observation and not missing.done
    final = env.step(turn("The answer is 5.", 4))
    assert final.done and not final.observation


def test_calculator_call_limit():
    env = Calculator({"prompt": "p"}, max_calls=2)
    assert not env.step(turn(call_text("calculator", expression="1"))).done
    assert not env.step(turn(call_text("calculator", expression="2"))).done
    over = env.step(turn(call_text("calculator", expression="3")))
    assert over.done and "limit is 2" in over.observation


# --- python -----------------------------------------------------------------------------------------

def test_python_prints_output():
    env = Python({"prompt": "p"})
    step = env.step(turn(call_text("python", code="print(sum(range(10)))")))
    assert (step.observation, step.done) == ("45\n", False)
    assert env.step(turn("The answer is 45.")).done


def test_python_no_output_and_errors_are_observations():
    env = Python({"prompt": "p"}, site_packages=False)
    assert env.step(turn(call_text("python", code="x = 1"))).observation == "(no output)"
    raised = env.run("print('before')\n1/0")
    assert raised.startswith("error: exit code 1\nbefore\n") and "ZeroDivisionError" in raised
    assert 'File "<code>", line 2' in raised  # the model's own code, not the sandbox's paths
    assert env.run("import sys; sys.exit(3)") == "error: exit code 3"
    assert env.step(turn('<tool_call>{"name": "python"}</tool_call>')).observation.startswith("error: ")


def test_python_timeout_kills_the_process_group():
    env = Python({"prompt": "p"}, timeout_s=1, site_packages=False)
    # a child that would outlive its parent: it must die with the group
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import os, time; print(os.getpid(), flush=True); "
            "time.sleep(60)'])\n"
            "while True: pass")
    start = time.monotonic()
    observation = env.run(code)
    assert time.monotonic() - start < 4
    assert observation.startswith("error: timed out after 1 s")
    child = int(observation.splitlines()[1])
    deadline = time.monotonic() + 2
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    # a killed child is reparented; until its new parent reaps it, it is a zombie ("Z"), not alive
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_python_memory_limit():
    env = Python({"prompt": "p"}, memory_mb=256, site_packages=False)
    observation = env.run("x = bytearray(1024 ** 3)\nprint('allocated')")
    assert observation.startswith("error: ") and "MemoryError" in observation and "allocated" not in observation


def test_python_fresh_cwd_is_removed():
    env = Python({"prompt": "p"}, site_packages=False)
    code = "import os; print(os.getcwd()); print(os.listdir('.')); open('f.txt', 'w').write('x')"
    first = env.run(code).splitlines()
    second = env.run(code).splitlines()
    assert first[1] == second[1] == "[]"  # empty on entry, though the first run wrote a file
    assert first[0] != second[0]
    assert not os.path.exists(first[0]) and not os.path.exists(second[0])


def test_python_output_truncated():
    env = Python({"prompt": "p"}, max_output_chars=100, site_packages=False)
    observation = env.run("print('a' * 5000 + 'END')")
    assert TRUNCATED in observation and len(observation) <= 100 + len(TRUNCATED)
    assert observation.startswith("a") and observation.endswith("END\n")


def test_python_network_refused():
    # the socket is refused as it is made, before any connection; the env's own limit guards a leak
    env = Python({"prompt": "p"}, timeout_s=30, site_packages=False)
    observation = env.run('import socket; socket.create_connection(("1.1.1.1", 53))')
    assert observation.startswith("error: exit code 1") and "network access is disabled" in observation


NETWORK_PROBE = """
import subprocess, sys
# another interpreter, without the bootstrap's socket block, and ctypes' raw connect(2)
code = "import socket; socket.create_connection(('127.0.0.1', PORT), timeout=120); print('connected')"
child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
print("subprocess:", (child.stdout or child.stderr.strip().splitlines()[-1]).strip())
import ctypes, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
addr = struct.pack("=HH4s8x", socket.AF_INET, socket.htons(PORT), socket.inet_aton("127.0.0.1"))
print("ctypes:", "connected" if libc.connect(fd, addr, len(addr)) == 0 else "refused")
"""


def test_python_network_namespace_holds_for_subprocesses_and_ctypes():
    """A server on this process's loopback: code in the tool reaches it neither from another interpreter
    (no socket block there) nor by ctypes' connect(2), because it runs in a network namespace of its own;
    this process reaches the server (the probe can fail)."""
    import socket

    from tidal.executors.environments.python import NAMESPACE

    if Python.isolation() != NAMESPACE:
        pytest.skip("no network namespace can be made here (not root, no unprivileged user namespaces): "
                    "the python tool is best effort only")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=120).close()  # reachable from here
        env = Python({"prompt": "p"}, timeout_s=30, site_packages=False)
        observation = env.run(NETWORK_PROBE.replace("PORT", str(port)))
    assert "subprocess: OSError: [Errno 101] Network is unreachable" in observation, observation
    assert "ctypes: refused" in observation and "connected" not in observation, observation


def test_python_deterministic_set_order():
    env = Python({"prompt": "p"}, site_packages=False)
    code = "print(list({'alpha', 'beta', 'gamma', 'delta', 'epsilon'}))"
    assert env.run(code) == env.run(code)


def test_dry_run_says_how_the_python_tool_is_kept_off_the_network():
    from tidal.launch.cli import parser, resolve
    from tidal.launch.dryrun import _isolation

    cfg = resolve(parser().parse_args(["--algo", "grpo", "--set", "rollout=multi_turn", "--set", "multi_turn.env=python"]))
    line = _isolation(cfg)
    assert line.startswith("\nmulti_turn.env=python: ")
    assert ("network namespace of its own" in line) == (Python.isolation() == "network namespace")
    lookup = resolve(parser().parse_args(["--algo", "grpo", "--set", "rollout=multi_turn"]))
    assert _isolation(lookup) == ""  # an environment that runs no code says nothing
