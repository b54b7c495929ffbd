"""The example tools and the one way a tool is called: every fault of a tool becomes an error
message the model reads, flagged so the workflow counts it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from dora_megatron.workflow.tools import (Calculator, PythonExecutor, ToolError, call_tool, evaluate, make_tools,
                                          parse_tool_calls)


def run(coro):
    return asyncio.run(coro)


def test_calculator_evaluates_arithmetic_and_refuses_code():
    assert run(Calculator()({"expression": "12 * (3 + 4) - 2 ** 3"})) == "76"
    assert run(Calculator()({"expression": "7 / 2"})) == "3.5"
    assert run(Calculator()({"expression": "sqrt(81)"})) == "9"
    with pytest.raises(ToolError, match="unsupported"):
        evaluate("__import__('os').system('true')")
    with pytest.raises(ToolError, match="exponent"):
        evaluate("9 ** 9 ** 9")
    with pytest.raises(ToolError, match="division by zero"):
        evaluate("1 / 0")


class Raises:
    name = "raises"
    schema: dict = {}

    async def __call__(self, arguments):
        raise KeyError("boom")


class Hangs:
    name = "hangs"
    schema: dict = {}

    def __init__(self):
        self.cancelled = False

    async def __call__(self, arguments):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class Garbage:
    name = "garbage"
    schema: dict = {}

    async def __call__(self, arguments):
        return {"not": "text"}


def test_a_tool_that_raises_hangs_or_answers_garbage_gives_the_model_an_error():
    hangs = Hangs()
    tools = {"raises": Raises(), "hangs": hangs, "garbage": Garbage(), "calculator": Calculator()}
    raised = run(call_tool(tools, "raises", {}, timeout_s=5))
    assert raised.error and not raised.timed_out and "KeyError" in raised.content
    hung = run(call_tool(tools, "hangs", {}, timeout_s=0.05))
    assert hung.error and hung.timed_out and "did not finish" in hung.content
    assert hangs.cancelled  # the hung call was stopped, not left running
    garbage = run(call_tool(tools, "garbage", {}, timeout_s=5))
    assert garbage.error and "returned a dict" in garbage.content
    unknown = run(call_tool(tools, "search", {}, timeout_s=5))
    assert unknown.error and "no tool named 'search'" in unknown.content
    bad_args = run(call_tool(tools, "calculator", ["1+1"], timeout_s=5))
    assert bad_args.error and "JSON object" in bad_args.content
    ok = run(call_tool(tools, "calculator", {"expression": "2+2"}, timeout_s=5))
    assert ok == type(ok)("4")


def test_python_executor_returns_stdout_and_reports_failures():
    py = PythonExecutor(timeout_s=20, memory_mb=256)
    assert run(py({"code": "print(sum(range(10)))"})) == "45\n"
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        run(py({"code": "1/0"}))


def test_python_executor_is_killed_at_its_time_limit():
    py = PythonExecutor(timeout_s=0.5)
    res = run(call_tool({"python": py}, "python", {"code": "import time\nwhile True: time.sleep(0.01)"},
                        timeout_s=0.5))
    assert res.timed_out and res.error


def test_python_executor_memory_limit_stops_a_large_allocation():
    py = PythonExecutor(timeout_s=20, memory_mb=128)
    with pytest.raises(ToolError, match="MemoryError"):
        run(py({"code": "x = bytearray(1024 * 1024 * 1024)"}))
    assert run(PythonExecutor(timeout_s=20, memory_mb=2048)({"code": "x = bytearray(64 << 20); print(len(x))"})) \
        == f"{64 << 20}\n"


def test_parse_tool_calls_in_qwen3_format():
    text = ('Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
            '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"\n</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "x"}')
    calls = parse_tool_calls(text)
    assert calls[0] == ("calculator", {"expression": "2+3"})
    assert isinstance(calls[1], str) and "not valid JSON" in calls[1]
    assert isinstance(calls[2], str) and '"name"' in calls[2]
    assert isinstance(calls[3], str) and "not closed" in calls[3]
    assert parse_tool_calls("The answer is 5.") == []


def test_make_tools_names_an_unknown_tool():
    assert sorted(make_tools(["calculator", "python"], {})) == ["calculator", "python"]
    with pytest.raises(ValueError, match="no tool 'search'"):
        make_tools(["search"], {})


def test_python_executor_at_its_time_limit_kills_what_the_program_started(tmp_path):
    """The program's own child (a second interpreter it starts) dies with it at the time limit."""
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
            "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(60)\n")
    res = run(call_tool({"python": PythonExecutor(timeout_s=30)}, "python", {"code": code}, timeout_s=3))
    assert res.timed_out
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:  # the fault this test is about: clean it up before failing
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the program's child outlived the time limit"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead (only not yet reaped by its parent)
