"""The `calculator` environment: the model may call a calculator tool before it answers.

The expression is evaluated by walking its `ast`, never by `eval`: only numbers, + - * / // % **,
unary + and -, and parentheses are allowed (no names, calls, attributes or subscripts), so the model
cannot reach Python. The input length and every integer's size are capped (a power is refused before
it is computed when its result would be too large), so `9**9**9` is an error, not a hang.
Results follow Python's arithmetic: 7/2 -> 3.5, 10/2 -> 5.0, 7//2 -> 3.
"""
from __future__ import annotations

import ast
import math
import operator

from tidal.executors.environments.base import ENVS
from tidal.executors.environments.toolcall import ToolCall, ToolEnv, tool_schema

MAX_EXPRESSION_CHARS = 500
MAX_INT_BITS = 4096  # about 1233 decimal digits: any answer a model needs, and cheap to compute

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """An expression that cannot be evaluated; the message is meant for the model."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression, or CalculatorError saying why not."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"invalid syntax: {exc.msg}") from None
    except (RecursionError, MemoryError):  # absurdly deep nesting
        raise CalculatorError("expression nested too deeply") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result too large") from None
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        # bool is an int subclass; complex (1j) is a number the calculator does not do
        if type(value) not in (int, float):
            raise CalculatorError(f"not a number: {value!r}")
        return _checked(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    raise CalculatorError(f"not allowed: {_describe(node)} (only numbers, + - * / // % ** and parentheses)")


def _check_power(base: int | float, exponent: int | float) -> None:
    # refuse before computing: 9**(9**9) would take minutes and gigabytes to build
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
            raise CalculatorError("result too large")
    if isinstance(base, (int, float)) and base < 0 and isinstance(exponent, float) and not exponent.is_integer():
        raise CalculatorError("a negative number to a fractional power is not a real number")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError("result too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large")  # float overflow gives inf, not an exception
    if not isinstance(value, (int, float)):  # e.g. a complex number, should any slip through
        raise CalculatorError("the result is not a real number")
    return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.BinOp):
        return f"the operator {type(node.op).__name__}"
    return {ast.Call: "function calls", ast.Attribute: "attributes", ast.Subscript: "subscripts",
            ast.Compare: "comparisons", ast.BoolOp: "and/or"}.get(type(node), type(node).__name__)


def format_result(value: int | float) -> str:
    return repr(value)  # repr: the shortest text that reads back as the same float


class Calculator(ToolEnv):
    """Answers `calculator` tool calls; deterministic (the result is a function of the expression)."""

    inline = True  # microseconds of arithmetic: cheaper on the decode loop than a thread's hand-off (pool.py)

    deterministic = True
    TOOLS = [tool_schema("calculator", "Evaluate an arithmetic expression: numbers, + - * / // % ** and "
                         "parentheses.", {"expression": "the expression, e.g. (2+3)*4"})]

    def call(self, call: ToolCall) -> str:
        try:
            return format_result(evaluate(call.text_argument("expression")))
        except CalculatorError as exc:
            return f"error: {exc}"


ENVS.register("calculator", Calculator)
