import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.rollout.cursor import (
    PromptCursor,
    audit_positions,
    epoch_order,
    epochs_consumed,
    group_outcome,
    positions_from,
    prompts_consumed,
    request_seed,
    restart_cursor,
    row_at,
    samples_consumed,
    split_by_checkpoint,
)


@st.composite
def histories(draw):
    """Groups finish in any order with 0..3 samples; samples are consumed in any order."""
    n = draw(st.integers(1, 25))
    sizes = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    finish_order = draw(st.permutations(range(n)))
    return sizes, finish_order, draw(st.randoms(use_true_random=False))


@given(histories(), st.integers(0, 200))
def test_cursor_tracks_consumed_positions_whatever_the_order(history, stop_after) -> None:
    sizes, order, rng = history
    cursor = PromptCursor()
    queue: list[int] = []
    consumed: set[int] = set()
    events = 0
    for position in order:
        cursor = group_outcome(cursor, position, sizes[position])
        queue.extend([position] * sizes[position])
        if sizes[position] == 0:
            consumed.add(position)
        rng.shuffle(queue)
        while queue and rng.random() < 0.5 and events < stop_after:
            taken = queue.pop()
            cursor = samples_consumed(cursor, [taken])
            events += 1
            if taken not in queue:
                consumed.add(taken)
        # Invariant: exactly the consumed positions are reported consumed.
        assert {p for p in range(len(sizes)) if cursor.is_consumed(p)} == consumed
        assert prompts_consumed(cursor) == len(consumed)
        assert cursor.next_untrained == min(set(range(len(sizes) + 1)) - consumed)
        # Resume: the worker regenerates exactly the unconsumed positions none of whose
        # samples was taken; a group split by the checkpoint has its samples left dropped.
        split = {p: queue.count(p) for p in set(queue) if queue.count(p) < sizes[p]}
        assert split_by_checkpoint(cursor.to_json()) == split
        restored = PromptCursor.from_json(cursor.to_json())
        resumed = set(positions_from(restored, stop=len(sizes)))
        assert resumed == set(range(len(sizes))) - consumed - set(split)
        # A resume that restores the queued samples: the cursor as it was, and the worker
        # generates only the positions with neither an outcome nor a sample queued.
        with_queue = PromptCursor.with_queue_restored(cursor.to_json())
        assert with_queue == cursor
        generated = set(positions_from(restart_cursor(with_queue), stop=len(sizes)))
        assert generated == set(range(len(sizes))) - consumed - set(queue)


@given(
    st.lists(st.sampled_from([0, 3]), min_size=1, max_size=25),
    st.randoms(use_true_random=False),
    st.integers(0, 200),
)
def test_the_audit_finds_each_position_once_and_names_a_repeat_or_a_loss(sizes, rng, takes) -> None:
    """A record written as the trainer writes it (each sample taken is trained, each empty
    group dropped) audits exact against the saved cursor, groups it split included; a sample
    recorded twice, a lost one, or one of a group the cursor never saw taken is named
    (negative controls)."""
    cursor, queue, rows = PromptCursor(), [], []
    for step, position in enumerate(rng.sample(range(len(sizes)), len(sizes))):
        cursor = group_outcome(cursor, position, sizes[position])
        queue.extend([position] * sizes[position])
        row = {"step": step, "trained": [], "zero_reward_spread": []}
        if sizes[position] == 0:
            row["zero_reward_spread"].append(position)
        rng.shuffle(queue)
        while queue and rng.random() < 0.7 and takes > 0:
            takes -= 1
            taken = queue.pop()
            cursor = samples_consumed(cursor, [taken])
            row["trained"].append(taken)
        rows.append(row)
    saved = cursor.to_json()
    audit = audit_positions(rows, saved, samples_per_group=3)
    assert audit.exact, audit
    consumed = [p for p in range(len(sizes)) if cursor.is_consumed(p)]
    split = split_by_checkpoint(saved)
    assert audit.consumed == len(consumed) and audit.split == len(split)
    assert audit.trained_samples == 3 * sum(sizes[p] > 0 for p in consumed) + sum(
        3 - left for left in split.values()
    )
    trained = [p for p in [*consumed, *split] if sizes[p] == 3]
    if trained:
        again = [*rows, {"step": len(rows), "trained": [trained[0]]}]
        assert audit_positions(again, saved, 3).repeated == (trained[0],)
        lost = [
            {k: v if k == "step" else [p for p in v if p != trained[0]] for k, v in r.items()}
            for r in rows
        ]
        assert audit_positions(lost, saved, 3).missing == (trained[0],)
    queued = [p for p in range(len(sizes)) if sizes[p] == 3 and p not in trained]
    if queued:  # a group whose samples all wait on the queue: not in the record
        extra = [*rows, {"step": len(rows), "trained": [queued[0]]}]
        assert audit_positions(extra, saved, 3).unconsumed == (queued[0],)


def test_consuming_twice_or_without_a_group_is_an_error() -> None:
    cursor = group_outcome(PromptCursor(), 0, 0)
    with pytest.raises(ValueError, match="already has an outcome"):
        group_outcome(cursor, 0, 1)
    with pytest.raises(ValueError, match="no pending group"):
        samples_consumed(cursor, [3])
    with pytest.raises(ValueError, match="missing key 'consumed_after'"):
        PromptCursor.from_json({"next_untrained": 3})


def test_epochs_count_distinct_prompts() -> None:
    cursor = PromptCursor()
    for position in range(6):
        cursor = group_outcome(cursor, position, 0)
    assert epochs_consumed(cursor, dataset_size=4) == 1.5


@given(st.integers(1, 50), st.integers(0, 5), st.integers(0, 2**31))
def test_each_epoch_visits_every_row_once(n, epoch, seed) -> None:
    order = epoch_order(n, epoch, seed)
    assert sorted(order.tolist()) == list(range(n))
    rows = [row_at(epoch * n + i, n, seed) for i in range(n)]
    assert {r for _, r in rows} == set(range(n))
    assert {e for e, _ in rows} == {epoch}
    np.testing.assert_array_equal(order, epoch_order(n, epoch, seed))


@given(st.integers(0, 2**31), st.integers(-1, 10**6), st.integers(0, 64), st.integers(0, 16))
def test_request_seed_is_a_pure_function_in_range(seed, position, index, turn) -> None:
    value = request_seed(seed, position, index, turn)
    assert value == request_seed(seed, position, index, turn)
    assert 0 <= value < 2**63
    neighbours = {
        request_seed(seed, position + 1, index, turn),
        request_seed(seed, position, index + 1, turn),
        request_seed(seed, position, index, turn + 1),
        request_seed(seed + 1, position, index, turn),
    }
    assert value not in neighbours and len(neighbours) == 4
