"""A calculator task behind an MCP server, as OpenEnv harness sessions (no sandbox, no network).

Each session asks for a product and offers one MCP tool, ``multiply``, served by a FastMCP
server in the session's own process (its in-memory transport). The reward, forwarded by
``verify()``, is 1.0 when the agent called ``multiply`` and 0.0 otherwise. The model of the
tests (tests/support/replying_model.py) calls ``multiply`` in one reply of eight, so rewards
differ within a group and a trainer can raise them.

:class:`CalculatorAgents` makes the same task black-box: each session starts
``calculator_agent.py``, an agent process that calls the trainer's capture endpoint
(:func:`asyncgrpo.capture_url`) and runs ``multiply`` itself.

A row's ``fault`` column makes a rollout misbehave on purpose: ``create`` (the factory
raises), ``tool_error`` (the tool server is gone: every call raises), ``hang`` (the session's
first call blocks until the session is closed, as a harness stuck in its sandbox would),
``nan`` (``verify()`` forwards NaN) or ``crash`` (:class:`CrashingAdapter`'s harness raises
after the model's first turn).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, ClassVar

import psutil
from fastmcp import Client, FastMCP
from openenv.core.env_server.mcp_types import Tool
from openenv.core.harness import (
    MCPHarnessAdapter,
    ResourceSession,
    ResourceSessionFactory,
    ToolResult,
    VerifyResult,
)

MULTIPLY = Tool(
    name="multiply",
    description="Multiply two integers.",
    input_schema={
        "type": "object",
        "required": ["a", "b"],
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    },
)


def calculator_server() -> FastMCP:
    server = FastMCP("calculator")

    @server.tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    return server


class CalculatorSession(ResourceSession):
    """One rollout's calculator: the question, the MCP tool, the reward."""

    created_sessions = 0  # across the process, for the tests' checks
    closed_sessions = 0
    _count_lock = threading.Lock()

    def __init__(self, task: dict[str, Any]) -> None:
        self.task = dict(task)
        self.fault = self.task.get("fault")
        self.server = calculator_server()
        self.called = False
        self.closed = threading.Event()
        with CalculatorSession._count_lock:
            CalculatorSession.created_sessions += 1

    def initial_messages(self) -> list[dict[str, Any]]:
        if self.fault == "hang":
            self.closed.wait()
        a, b = self.task.get("a", 2), self.task.get("b", 2)
        return [{"role": "user", "content": f"What is {a}*{b}? Use the multiply tool."}]

    def list_tools(self) -> list[Tool]:
        return [MULTIPLY]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name != MULTIPLY.name:
            raise KeyError(f"Unknown tool: {name}")
        if self.fault == "tool_error":
            raise ConnectionResetError("the calculator's MCP server went away")
        self.called = True
        result = asyncio.run(self._call(name, arguments))
        return ToolResult(data=result)

    async def _call(self, name: str, arguments: dict[str, Any]) -> Any:
        async with Client(self.server) as client:
            reply = await client.call_tool(name, arguments)
            return reply.data

    def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> VerifyResult:
        if self.fault == "nan":
            return VerifyResult(env_reward=float("nan"))
        return VerifyResult(env_reward=1.0 if self.called else 0.0, done=True)

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            with CalculatorSession._count_lock:
                CalculatorSession.closed_sessions += 1


class CalculatorSessions(ResourceSessionFactory[CalculatorSession]):
    """The factory: one :class:`CalculatorSession` per rollout, on the rollout's row."""

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> CalculatorSession:
        if (task or {}).get("fault") == "create":
            raise RuntimeError("no calculator could be started")
        return CalculatorSession(task or {})


class CrashingAdapter(MCPHarnessAdapter):
    """OpenEnv's MCP harness, except that on a row whose ``fault`` is ``crash`` it raises after
    the model's first turn, as a harness whose process died would."""

    def run_white_box(self, model_step, session, limits=None):
        if session.task.get("fault") == "crash":
            model_step(session.initial_messages(), session.list_tools(), {})
            raise RuntimeError("the harness process died (exit code -9)")
        return super().run_white_box(model_step, session, limits)


AGENT = Path(__file__).with_name("calculator_agent.py")


class AgentSession(ResourceSession):
    """One rollout's black-box agent: a process of ``calculator_agent.py`` pointed at the
    trainer's capture endpoint; the reward is 1.0 when it called ``multiply``. A row's
    ``fault`` (``crash``, ``hang``) reaches the agent."""

    started: ClassVar[list[psutil.Process]] = []  # across the process, for the tests' checks

    def __init__(self, task: dict[str, Any], episode_id: str) -> None:
        from asyncgrpo import capture_url

        self.task = dict(task)
        self.report = Path(tempfile.mkdtemp(prefix="calculator-agent-")) / "report.json"
        question = (
            f"What is {self.task.get('a', 2)}*{self.task.get('b', 2)}? Use the multiply tool."
        )
        env = {**os.environ, "OPENAI_BASE_URL": capture_url(episode_id)}
        if self.task.get("fault") in ("crash", "hang"):
            env["CALCULATOR_AGENT_FAULT"] = self.task["fault"]
        self.question = question
        self.process = subprocess.Popen(
            [sys.executable, str(AGENT), str(self.report), question],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        AgentSession.started.append(psutil.Process(self.process.pid))

    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.question}]

    def list_tools(self) -> list[Tool]:
        return [MULTIPLY]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        raise KeyError(f"the agent runs its own tools, not {name}")

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired as error:
            raise TimeoutError(f"the agent did not exit in {timeout_s} s") from error

    def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> VerifyResult:
        calls = json.loads(self.report.read_text())["multiply_calls"] if self.report.exists() else 0
        return VerifyResult(env_reward=1.0 if calls else 0.0, done=True)

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


class CalculatorAgents(ResourceSessionFactory[AgentSession]):
    """The black-box factory: one agent process per rollout."""

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> AgentSession:
        return AgentSession(task or {}, str(episode_id))
