import re
from collections import Counter

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from packing_strategies import make_sample, sample_sets

from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.core.run.planner import (
    BATCH_METRICS,
    PlanState,
    add_sample,
    added_cost,
    attention_cost,
    batch_metrics,
    pack_step,
    plan_step,
    step_observations,
)

plans = st.tuples(
    sample_sets(max_groups=6), st.integers(4, 40), st.integers(1, 3), st.integers(1, 3)
)

# TRL's AsyncGRPOTrainer (documentation): the budget also bounds a row's loss terms. Three
# identical 6-token samples (5 trained tokens each) forward 6 tokens but hold 15 loss terms.
IDENTICAL = [make_sample([1, 2, 3, 4, 5, 6], [0, 1, 1, 1, 1, 1], rollout=f"r{i}") for i in range(3)]

# The documentation's full-home-row rule: two processes, budget 10; the third sample's home row
# (the first's) is full, no row is empty, and the other row would become the most loaded.
HOME_FULL = [
    make_sample([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 1], group=0),
    make_sample([9, 9], [0, 1], group=1),
    make_sample([1, 2, 7, 7, 7, 7], [0, 0, 1, 1, 1, 1], group=0),
]


@given(plans)
def test_every_sample_is_placed_dropped_or_left_exactly_once(case) -> None:
    samples, budget, processes, accumulation = case
    plan = plan_step(samples, budget, processes, accumulation)
    seen = Counter(plan.placed) + Counter(plan.dropped_oversize) + Counter(plan.leftover)
    assert seen == Counter(range(len(samples)))
    assert all(len(samples[i].sequence) > budget for i in plan.dropped_oversize)
    assert len(plan.micro_batches) <= accumulation
    assert all(len(mb) == processes for mb in plan.micro_batches)
    assert plan.leftover == tuple(sorted(plan.leftover))


@given(plans)
@example((IDENTICAL, 6, 1, 3))  # negative control: one row of 15 loss terms without the bound
def test_budget_holds_and_planned_tokens_and_cost_match_the_packed_row(case) -> None:
    samples, budget, processes, accumulation = case
    plan = plan_step(samples, budget, processes, accumulation)
    for mb in plan.micro_batches:
        for row in mb:
            if not row.samples:
                assert row.tokens == row.cost == row.loss_terms == 0
                continue
            packed = pack_row([samples[i] for i in row.samples])
            assert packed.num_tokens == row.tokens <= budget
            assert len(packed.target_ids) == row.loss_terms <= budget  # trained tokens, summed
            assert attention_cost(packed.position_ids) == row.cost
            assert packed.unpacked_tokens >= packed.num_tokens


def _offer(rows, offered, sample, budget):
    """Per open row: (it fits, cost after adding ``sample``), from the packed row itself;
    ``offered`` are the samples offered to the plan so far (a row holds indices into it)."""
    offers = []
    for row in rows:
        packed = pack_row([*(offered[i] for i in row.samples), sample])
        fits = max(packed.num_tokens, len(packed.target_ids)) <= budget
        offers.append((fits, attention_cost(packed.position_ids)))
    return offers


@given(plans)
@example((HOME_FULL, 10, 2, 2))  # negative control: placed in the other row without the rule
def test_each_sample_goes_where_the_documentation_places_it(case) -> None:
    """Rules 2 to 4 of the planner, checked sample by sample against packed rows: the cheapest
    home row it fits; else the cheapest row it fits, which a sample with a full home row takes
    only while a row is empty or when it does not exceed the most loaded row; else the
    micro-batch closes (and a sample fitting no row always closes it)."""
    samples, budget, processes, accumulation = case
    state = PlanState(budget, processes, accumulation)
    offered = [s for s in samples if len(s.sequence) <= budget]
    for sample in offered:
        before = state
        state = add_sample(state, sample)
        if before.full:
            break
        offers = _offer(before.rows, offered, sample, budget)
        home = [r for r, groups in enumerate(before.row_groups) if sample.group_id in groups]
        home_fits = [offers[r][1] for r in home if offers[r][0]]
        fitting = [cost for fits, cost in offers if fits]
        empty = any(not row.samples for row in before.rows)
        most_loaded = max(row.cost for row in before.rows)
        allowed = [c for c in fitting if not home or empty or c <= most_loaded]
        if state.closed == before.closed and not state.full:  # placed in the open micro-batch
            (r,) = [r for r, row in enumerate(state.rows) if before.placed in row.samples]
            assert offers[r][0]
            assert offers[r][1] == min(home_fits or allowed)
            assert r in home or not home_fits
        else:
            assert not home_fits and not allowed


def test_group_affinity_and_balancing() -> None:
    prompt = [1, 2, 3, 4, 5, 6]
    group0 = [make_sample([*prompt, 10 + i, 20 + i], [0] * 6 + [1, 1], group=0) for i in range(3)]
    other = make_sample([9, 8, 7, 6], [0, 1, 1, 1], group=1)
    plan = plan_step([group0[0], other, group0[1], group0[2]], token_budget=64, num_processes=2)
    (mb,) = plan.micro_batches
    assert mb[0].samples == (0, 2, 3)  # the group stays together, sharing its prompt
    assert mb[1].samples == (1,)  # the other group takes the empty row


@given(plans, st.integers(0, 5))
def test_a_packed_step_holds_each_planned_row_and_the_metrics_of_its_samples(case, version):
    samples, budget, processes, accumulation = case
    plan = plan_step(samples, budget, processes, accumulation)
    taken = [[tuple(samples[i] for i in row.samples) for row in mb] for mb in plan.micro_batches]
    packed = pack_step(taken)
    assert [[row is None for row in mb] for mb in packed.micro_batches] == [
        [not row for row in mb] for mb in taken
    ]
    assert packed.forwarded_tokens == sum(row.tokens for mb in plan.micro_batches for row in mb)
    assert all(row.samples[0].sequence.sampler_top_logprobs is None for row in packed.rows)
    observed = {o.name: o.amount for o in step_observations(packed, version, 10.0, budget, 8)}
    # the step queue counts what it drops as oversize; a step's own rows drop nothing
    assert set(BATCH_METRICS) - set(observed) == {"batch/dropped_oversize_count"}
    assert observed["batch/samples_per_step"] == len(plan.placed)
    if plan.placed:  # make_sample's samples come from version 0, queued at time 0
        assert observed["sample/staleness_max"] == version
        assert observed["sample/time_in_queue_s"] == 10.0
        quarters = [n for n in observed if re.fullmatch(r"sample/length_q\d/staleness_mean", n)]
        assert quarters and all(observed[n] == version for n in quarters)
    else:
        assert "sample/staleness_max" not in observed


def test_step_leaves_the_rest_for_the_next_one() -> None:
    samples = [make_sample([i, i + 1, i + 2], [0, 1, 1], group=i) for i in range(0, 30, 3)]
    plan = plan_step(samples, token_budget=6, num_processes=1, gradient_accumulation_steps=2)
    assert len(plan.micro_batches) == 2 and plan.complete
    assert plan.leftover == tuple(range(4, 10))


def test_added_cost_matches_packed_rows() -> None:
    a = make_sample([1, 2, 3, 4, 5], [0, 0, 0, 1, 1])
    b = make_sample([1, 2, 3, 7, 8], [0, 0, 0, 1, 1])
    row = pack_row([a, b])
    assert attention_cost(row.position_ids) == added_cost(5, 0) + added_cost(5, 2)


def test_batch_metrics_of_the_worked_example() -> None:
    r0 = make_sample([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], group=0)
    r1 = make_sample([1, 2, 3, 6, 7], [0, 0, 0, 1, 1], group=0)
    lone = make_sample([8, 9], [0, 1], group=1)
    metrics = batch_metrics(
        [[pack_row([r0, r1]), pack_row([lone])]], token_budget=10, dropped_oversize=2
    )
    assert metrics["batch/packing_ratio"] == pytest.approx(12 / 10)
    assert metrics["batch/forwarded_tokens_per_step"] == 10
    assert metrics["batch/trained_tokens_per_step"] == 5
    assert metrics["batch/samples_per_row"] == 1.5
    assert metrics["batch/row_tokens_max"] == 8
    assert metrics["batch/row_fill_frac"] == pytest.approx(0.5)
    assert metrics["batch/pad_frac"] == pytest.approx(1 - 10 / 16)
    # of the samples' 12 tokens (shared ones once per sample, as the documentation counts), 5
    # are trained; the packed row's 10 positions would give 1 - 5/10
    assert metrics["batch/masked_token_frac"] == pytest.approx(1 - 5 / 12)
    assert metrics["batch/groups_per_step"] == 2
    assert metrics["batch/dropped_oversize_count"] == 2
    costs = [1 + 2 + 3 + 4 + 5 + 3 + 4 + 5, 1 + 2]
    assert metrics["batch/row_imbalance"] == pytest.approx(max(costs) / (sum(costs) / 2))


@given(sample_sets())
def test_packing_ratio_is_one_exactly_when_nothing_is_shared(samples) -> None:
    row = pack_row(samples)
    ratio = batch_metrics([[row]], token_budget=1000)["batch/packing_ratio"]
    assert ratio >= 1.0
    assert (ratio == 1.0) == (row.num_tokens == row.unpacked_tokens)


def test_among_rows_holding_the_group_the_cheapest_takes_the_sample() -> None:
    """The group's first two samples land in different rows (the second does not fit the
    first's row); the third fits both and goes to the cheaper, not the first."""
    a = make_sample([1, 2, 3, *range(4, 11)], [0, 0, 0] + [1] * 7, group=0)
    b = make_sample([1, 2, 3, 20, 21, 22, 23, 24], [0, 0, 0] + [1] * 5, group=0)
    c = make_sample([1, 2, 3, 30], [0, 0, 0, 1], group=0)
    plan = plan_step([a, b, c], token_budget=12, num_processes=2)
    (mb,) = plan.micro_batches
    assert mb[0].samples == (0,) and mb[1].samples == (1, 2)
    assert mb[1].cost < attention_cost(pack_row([a, c]).position_ids)


def test_the_budget_bounds_a_rows_loss_terms() -> None:
    """Three identical 6-token samples forward 6 tokens together but hold 15 loss terms: with
    a budget of 6 each takes a row of its own (5 loss terms)."""
    plan = plan_step(IDENTICAL, token_budget=6, num_processes=1, gradient_accumulation_steps=3)
    assert [[row.samples for row in mb] for mb in plan.micro_batches] == [[(0,)], [(1,)], [(2,)]]
    assert [mb[0].loss_terms for mb in plan.micro_batches] == [5, 5, 5]
    assert len(pack_row(IDENTICAL).target_ids) == 15 and pack_row(IDENTICAL).num_tokens == 6


def test_a_full_home_row_closes_the_micro_batch() -> None:
    """The documentation's example: the third sample's home row is full (11 tokens), no row is
    empty, and the other row would rise from cost 3 to 24, above the most loaded row's 21: the
    micro-batch closes and the sample opens the next one."""
    plan = plan_step(HOME_FULL, token_budget=10, num_processes=2, gradient_accumulation_steps=2)
    assert [[row.samples for row in mb] for mb in plan.micro_batches] == [
        [(0,), (1,)],
        [(2,), ()],
    ]
    one = plan_step(HOME_FULL, token_budget=10, num_processes=2)
    assert one.leftover == (2,)


def test_a_full_home_row_still_moves_while_a_row_is_empty_or_the_load_does_not_rise() -> None:
    """A sample whose home row is full goes on to an empty row, and to a non-empty row whose
    cost after stays within the most loaded row's (3 + 10 = 13 against 36)."""
    home = make_sample([1, 2, 3, 4, 5, 6, 7, 8], [0, 0] + [1] * 6, group=0)
    light = make_sample([9, 9], [0, 1], group=1)
    moving = make_sample([1, 2, 5, 5], [0, 0, 1, 1], group=0)  # 3 new tokens: 11 at home
    plan = plan_step([home, moving], token_budget=10, num_processes=2)
    assert [row.samples for row in plan.micro_batches[0]] == [(0,), (1,)]
    plan = plan_step([home, light, moving], token_budget=10, num_processes=2)
    assert [row.samples for row in plan.micro_batches[0]] == [(0,), (1, 2)]
    assert plan.micro_batches[0][1].cost == 13 <= plan.micro_batches[0][0].cost == 36


@given(sample_sets())
def test_masked_token_frac_is_the_untrained_share_of_the_samples_tokens(samples) -> None:
    row = pack_row(samples)
    metrics = batch_metrics([[row]], token_budget=1000)
    unpacked = sum(len(s.sequence) for s in samples)
    assert 0.0 <= metrics["batch/masked_token_frac"] <= 1.0
    assert metrics["batch/masked_token_frac"] == pytest.approx(
        1 - metrics["batch/trained_tokens_per_step"] / unpacked
    )
