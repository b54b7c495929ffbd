"""Tools a workflow's model may call, and the one way every call is made (:func:`call_tool`).

WHY errors become text: a tool that raises, hangs or answers garbage is part of the environment the
policy learns in, not a failure of the run. The model is shown an error message as the tool's
result (it can learn to call the tool correctly) and the call is counted (``env/tool_errors``,
``env/tool_timeouts``). Only an environment that cannot go on at all (a workflow that raises) fails
the sample, which is then run again (:mod:`.runner`).

The two example tools are a calculator (arithmetic on an AST: no ``eval``) and a Python executor
that runs the code in a fresh interpreter subprocess, isolated (``-I``), with a wall-clock limit and
an address-space limit, so a runaway program cannot stall or starve the controller.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import operator
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence


class Tool(Protocol):
    """One tool: its ``name``, the JSON schema of its function (passed to the chat template as
    ``tools=``), and the coroutine that runs it on the parsed arguments and returns its result text."""

    name: str
    schema: Mapping[str, Any]

    async def __call__(self, arguments: Mapping[str, Any]) -> str: ...


@dataclass(frozen=True)
class ToolResult:
    """What the model is shown (``content``) and how the call went."""

    content: str
    error: bool = False
    timed_out: bool = False


class ToolError(Exception):
    """A tool's own refusal of its arguments: the message is what the model is shown."""


async def call_tool(tools: Mapping[str, Tool], name: Any, arguments: Any, timeout_s: float,
                    max_chars: int = 2000) -> ToolResult:
    """Run ``tools[name](arguments)`` within ``timeout_s``; never raises for the tool's faults: an
    unknown tool, arguments that are not an object, an exception, a hang, or a result that is not
    text each give an error message the model reads. Results longer than ``max_chars`` are cut."""
    tool = tools.get(name) if isinstance(name, str) else None
    if tool is None:
        return ToolResult(f"error: no tool named {name!r} (tools: {', '.join(sorted(tools))})", error=True)
    if not isinstance(arguments, Mapping):
        return ToolResult(f"error: the arguments of {name} must be a JSON object, not {type(arguments).__name__}",
                          error=True)
    try:
        out = await asyncio.wait_for(tool(arguments), timeout=timeout_s)
    except asyncio.TimeoutError:
        return ToolResult(f"error: {name} did not finish within {timeout_s:g} s", error=True, timed_out=True)
    except Exception as err:  # noqa: BLE001 - a tool's fault is shown to the model, not raised
        return ToolResult(f"error: {name} failed: {type(err).__name__}: {err}", error=True)
    if not isinstance(out, str):
        return ToolResult(f"error: {name} returned a {type(out).__name__}, not text", error=True)
    return ToolResult(out if len(out) <= max_chars else out[:max_chars] + "... (cut)")


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max}
#: the largest exponent the calculator raises to (``9**9**9`` would hold the controller for minutes)
MAX_EXPONENT = 1000


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic ``expression`` (numbers, + - * / // % **, parentheses and
    sqrt/abs/round/min/max). Raises :class:`ToolError` for anything else."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ToolError(f"not an arithmetic expression: {expression!r} ({err.msg})") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
            and not node.keywords):
        return _FUNCS[node.func.id](*(_eval(a) for a in node.args))
    raise ToolError(f"unsupported in an arithmetic expression: {ast.unparse(node)!r}")


class Calculator:
    """``calculator(expression)``: the value of an arithmetic expression, as text."""

    name = "calculator"
    schema = {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. 12 * (3 + 4).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ToolError("calculator needs a string 'expression'")
        value = evaluate(expression)
        return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


#: the child's first statements: cap the address space, then run the program (argv[2]) as ``__main__``
_LIMITED = ("import resource, sys\n"
            "_n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_AS, (_n, _n))\n"
            "_code = sys.argv[2]; del sys.argv[1:], _n\n"
            "exec(compile(_code, '<tool>', 'exec'), {'__name__': '__main__'})\n")


class PythonExecutor:
    """``python(code)``: run ``code`` in a fresh isolated interpreter; its stdout (and stderr when it
    fails) is the result. ``timeout_s`` kills its whole process group after that long (what the
    program started itself dies with it); ``memory_mb`` caps its address space (``RLIMIT_AS``), so
    an allocation beyond it raises ``MemoryError`` in the child instead of swapping the machine.

    WHY the limit is set by the child's first statement, not a ``preexec_fn``: the controller has
    threads (the background writer, the HTTP client's), and code run between fork and exec in a
    threaded process can deadlock (Python's subprocess documentation says so)."""

    name = "python"
    schema = {"type": "function", "function": {
        "name": "python", "description": "Run a Python program and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 256) -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError("python needs a string 'code'")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _LIMITED, str(self.memory_mb * 1024 * 1024), code,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the program and its children
            except ProcessLookupError:
                pass
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            raise ToolError(f"the program failed: {tail[0]}")
        return out.decode(errors="replace")


#: the example tools by the name ``workflow_kwargs.tools`` lists them
EXAMPLE_TOOLS = {"calculator": Calculator, "python": PythonExecutor}


def make_tools(names: Sequence[str], options: Mapping[str, Any]) -> dict[str, Tool]:
    """The example tools ``names`` asks for; the Python executor takes ``python_timeout_s`` and
    ``python_memory_mb`` from ``options``. Raises ValueError naming an unknown tool."""
    tools: dict[str, Tool] = {}
    for name in names:
        if name not in EXAMPLE_TOOLS:
            raise ValueError(f"rollout.workflow_kwargs.tools: no tool {name!r} (tools: {', '.join(EXAMPLE_TOOLS)})")
        if name == "python":
            tools[name] = PythonExecutor(float(options.get("python_timeout_s", 5.0)),
                                         int(options.get("python_memory_mb", 256)))
        else:
            tools[name] = EXAMPLE_TOOLS[name]()
    return tools


def parse_tool_calls(text: str) -> list[tuple[Any, Any] | str]:
    """The calls in a model turn written in Qwen3's format (``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>``, one block per call): ``(name, arguments)`` for each well-formed block, the
    parse error (a ``str``) for each malformed one, which the model is then shown."""
    calls: list[tuple[Any, Any] | str] = []
    rest = text
    while "<tool_call>" in rest:
        _, _, rest = rest.partition("<tool_call>")
        body, closed, rest = rest.partition("</tool_call>")
        if not closed:
            calls.append("error: a <tool_call> block is not closed by </tool_call>")
            break
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as err:
            calls.append(f"error: the tool call is not valid JSON ({err.msg} at character {err.pos})")
            continue
        if not isinstance(call, dict) or "name" not in call:
            calls.append('error: a tool call must be a JSON object with "name" and "arguments"')
            continue
        calls.append((call["name"], call.get("arguments", {})))
    return calls
