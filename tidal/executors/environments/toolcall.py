"""Tool calls in the Hermes format that Qwen2.5's and Qwen3's chat templates teach their models.

A model calls a tool by writing, anywhere in its turn,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2+3"}}
    </tool_call>

`parse_tool_call` reads the first such call. Small models often drop the tags: Qwen2.5-Coder-0.5B-Instruct
wrote its calls on HumanEval as a bare object, `{"name": ..., "arguments": {...}}`, alone or in a
```json fence, in 2 of 8 sampled turns, and never with the tags; a turn that is exactly such an object
(both keys) is read as a call too. Any other turn without `<tool_call>` is a final answer. A call
the model got wrong raises `MalformedCall`, whose message is written for the model to read (it is
sent back as the observation), so that it can fix the call on its next turn instead of the episode
crashing. `ToolEnv` is the shared episode logic of the tool environments (calculator.py, python.py):
a call -> its result as the observation, a malformed call -> the error, no call -> done.

`tool_schema` builds the JSON-schema dict a chat template's `tools=` argument takes, for prompts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Collection

from tidal.executors.environments.base import EnvStep, ModelTurn

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class MalformedCall(ValueError):
    """The model's tool call cannot be run; the message is meant for the model."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def text_argument(self, key: str) -> str:
        """The argument `key` as text (a number is accepted and written out), or MalformedCall."""
        value = self.arguments.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            raise MalformedCall(f"tool {self.name!r} needs the argument {key!r} (a string)")
        return value


def parse_tool_call(text: str, tools: Collection[str] | None = None) -> ToolCall | None:
    """The first tool call in `text`; None when there is none; MalformedCall when it is broken.

    `tools`: the names the environment offers (None: any name is accepted).
    """
    start = text.find(OPEN)
    if start < 0:
        return _bare_call(text, tools)
    body_start = start + len(OPEN)
    end = text.find(CLOSE, body_start)
    if end < 0:
        raise MalformedCall(f"no closing {CLOSE} after {OPEN}")
    call = _decode_call(text[body_start:end].strip())
    if tools is not None and call.name not in tools:
        raise MalformedCall(f"unknown tool {call.name!r}; tools: {', '.join(sorted(tools))}")
    return call


def _bare_call(text: str, tools: Collection[str] | None) -> ToolCall | None:
    """A turn that is one JSON object with "name" and "arguments" (in a ```json fence or not), as a call."""
    body = text.strip()
    if body.startswith("```"):
        first, _, rest = body.partition("\n")
        if first.strip("`").strip() not in ("", "json") or not rest.rstrip().endswith("```"):
            return None
        body = rest.rstrip()[:-3].strip()
    if not (body.startswith("{") and body.endswith("}")):
        return None
    try:
        obj = json.loads(body, strict=False)
    except json.JSONDecodeError:
        return None  # not a call: an answer that happens to be braces
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
        return None
    call = _decode_call(body)
    if tools is not None and call.name not in tools:
        raise MalformedCall(f"unknown tool {call.name!r}; tools: {', '.join(sorted(tools))}")
    return call


def _decode_call(body: str) -> ToolCall:
    obj = _loads(body, "tool call")
    if not isinstance(obj, dict):
        raise MalformedCall('a tool call is a JSON object {"name": ..., "arguments": {...}}')
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedCall('tool call has no "name" (a string)')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _loads(arguments, '"arguments"') if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise MalformedCall('"arguments" must be a JSON object')
    return ToolCall(name, arguments)


def _loads(text: str, what: str) -> Any:
    try:
        # strict=False: raw newlines inside strings (code written across lines) are accepted
        return json.loads(text, strict=False)
    except json.JSONDecodeError as exc:
        raise MalformedCall(f"{what} is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})") from None


def tool_schema(name: str, description: str, parameters: dict[str, str | dict]) -> dict:
    """The `tools=` entry of a chat template for a function tool; every parameter is required.

    `parameters`: argument name -> its description (a string argument), or its JSON schema (a dict).
    """
    properties = {key: {"type": "string", "description": spec} if isinstance(spec, str) else dict(spec)
                  for key, spec in parameters.items()}
    return {"type": "function",
            "function": {"name": name, "description": description,
                         "parameters": {"type": "object", "properties": properties,
                                        "required": list(parameters)}}}


def describe_tools(tools: list[dict]) -> str:
    """A system message that teaches the call format, for a chat template that does not render `tools=`
    itself (SmolLM2's, Llama 3.2's without tools): the Hermes format the environments parse."""
    schemas = "\n".join(json.dumps(tool) for tool in tools)
    return ("You may call tools to help you answer. Call one by writing\n"
            f'{OPEN}\n{{"name": <tool name>, "arguments": <an object of its arguments>}}\n{CLOSE}\n'
            "and end your turn; its result comes back in the next message. Answer without a tool call when you "
            f"are done. The tools:\n{schemas}")


class ToolEnv:
    """One episode of a model that may call tools before it answers.

    Subclasses set `TOOLS` (the `tool_schema`s they offer) and implement `call`, which returns the
    observation text (errors included: a tool never raises into the rollout). After `max_calls`
    calls the episode ends, so a model that never answers cannot loop until its token cap.
    """

    deterministic: ClassVar[bool] = True
    TOOLS: ClassVar[list[dict]] = []

    def __init__(self, sample: dict | None = None, *, tokenizer: Any = None, max_calls: int = 8) -> None:
        if max_calls < 1:
            raise ValueError(f"max_calls must be at least 1, got {max_calls}")
        self.sample = sample or {}
        self.tokenizer = tokenizer
        self.max_calls = max_calls
        self.calls = 0

    @classmethod
    def tool_names(cls) -> list[str]:
        return [tool["function"]["name"] for tool in cls.TOOLS]

    def reset(self) -> str | None:
        return None  # the tools are described by the prompt, not by a first observation

    def step(self, turn: ModelTurn) -> EnvStep:
        if turn.last:  # no turn would read a call's output: it is not run
            return EnvStep(done=True)
        try:
            call = parse_tool_call(turn.text, self.tool_names())
        except MalformedCall as exc:
            call, error = None, f"error: {exc}"
        else:
            if call is None:
                return EnvStep(done=True)  # no call: this turn is the final answer
            error = None
        self.calls += 1
        if self.calls > self.max_calls:
            return EnvStep(observation=f"error: no more tool calls (the limit is {self.max_calls})", done=True)
        if error is not None:
            return EnvStep(observation=error)
        try:
            observation = self.call(call)
        except MalformedCall as exc:  # e.g. a missing argument
            observation = f"error: {exc}"
        # "" would mean "nothing to append"; the model must still see that its call ran
        return EnvStep(observation=observation or "(no output)")

    def call(self, call: ToolCall) -> str:
        raise NotImplementedError
