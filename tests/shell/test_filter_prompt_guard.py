"""A ``filter_prompt`` that rejects every prompt stops the rollout loop with an error naming it,
with a dataset (a whole epoch rejected) and without one (the environment makes the prompts:
``REJECTIONS_WITHOUT_DATASET`` rejected in a row), instead of spinning for ever. The loop's
dispatcher is driven alone: nothing is admitted, so no server is needed."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest
from loop_harness import LocalChannels

from asyncgrpo import AsyncGRPOConfig, AsyncRolloutLoop
from asyncgrpo.shell.rollout import loop as rollout_loop

LIMIT = 50  # REJECTIONS_WITHOUT_DATASET for these tests: the default takes 10,000 calls


class RejectAll(AsyncRolloutLoop):
    """Rejects every prompt; fails the test instead of hanging if the loop spins past the
    guard."""

    calls = 0

    def filter_prompt(self, row_index, row, epoch):
        self.calls += 1
        assert self.calls <= 10 * LIMIT, "the dispatcher spun past the guard"
        return False


class Environment:
    def reset(self, **kwargs):
        return "Say a number."


def rejecting_loop(tmp_path, dataset) -> RejectAll:
    return RejectAll(
        AsyncGRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, disable_tqdm=True),
        "model",
        dataset,
        reward_funcs=[],
        processing_class=SimpleNamespace(eos_token_id=0),
        channels=LocalChannels(stop_after=10**9),
        max_model_len=64,
        token_budget=64,
        environment_factory=Environment if dataset is None else None,
    )


def dispatch(loop: RejectAll) -> None:
    """Run the dispatcher until it returns or raises; it admits nothing, so it starts no task
    in the task group and sends nothing (both None)."""
    anyio.run(loop._dispatch, None, None)


def test_without_a_dataset_a_streak_of_rejections_raises_naming_filter_prompt(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(rollout_loop, "REJECTIONS_WITHOUT_DATASET", LIMIT)
    loop = rejecting_loop(tmp_path, dataset=None)
    with pytest.raises(RuntimeError) as raised:
        dispatch(loop)
    assert str(raised.value) == (
        f"filter_prompt rejected {LIMIT} prompts in a row of a run without a train_dataset (the "
        "environment makes every prompt; each row is {} at epoch 0), so no batch can reach the "
        "trainer: make filter_prompt accept some of them"
    )
    assert loop.calls == LIMIT and len(loop.channels.outcomes) == LIMIT - 1


def test_with_a_dataset_a_rejected_epoch_raises(tmp_path) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"Number {i}?"}]} for i in range(6)]
    loop = rejecting_loop(tmp_path, dataset=rows)
    with pytest.raises(RuntimeError, match=r"^filter_prompt rejected all 6 prompts of an epoch"):
        dispatch(loop)
    assert loop.calls == 6
