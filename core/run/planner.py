"""The token-budget planner (TokenBudgetBatcher of TRL's AsyncGRPOTrainer) and a step's metrics.

A step is ``gradient_accumulation_steps`` micro-batches; a micro-batch is one row per process;
a row is tree-packed (:mod:`asyncgrpo.core.packing.tree`). As TRL's AsyncGRPOTrainer
(documentation) has it, ``token_budget`` bounds two counts of a row: its *forwarded* tokens,
shared tokens counted once, and its *loss terms*, the trained tokens summed over its samples
(each sample's trained token is its own term of the loss, shared or not: three identical
6-token samples with 5 trained tokens each forward 6 tokens and hold 15 loss terms). A sample
*fits* a row when both stay within the budget. Samples are placed in the order given:

1. a sample longer than ``token_budget`` fits no row: it is dropped and counted
   (``batch/dropped_oversize_count``); every other sample fits an empty row (its loss terms
   are at most its tokens);
2. its *home rows* are the rows of the open micro-batch that already hold its group (its
   prompt is there). Among those it fits, it goes to the one whose attention cost after
   adding it is lowest;
3. else it goes to the row, among those it fits, whose attention cost after adding it is
   lowest, under the documentation's full-home-row rule: a sample whose home row is full goes
   to another row only while some row of the micro-batch is empty or when that row's cost
   after adding it does not exceed the most loaded row's cost (the most loaded row sets the
   micro-batch's time); a sample of a group no row holds yet has no home row and takes the
   cheapest row it fits;
4. else the micro-batch closes and the sample opens the next one. After the step's last
   micro-batch the remaining samples are left for the next step.

**Attention cost model.** A row's cost is the number of (query, key) pairs its attention
computes: every forwarded token attends to its whole path, so a token at trie depth ``d`` costs
``d + 1`` and a row costs ``sum(position_ids + 1)``. Adding a sample of length ``L`` that shares
``h`` positions with the row adds ``(L(L+1) - h(h+1)) / 2``. It is proportional to attention
FLOPs, which dominate long rows; linear layers scale with forwarded tokens, which the budget
bounds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from asyncgrpo.core.frozen import FrozenMap
from asyncgrpo.core.metrics import Aggregation, Observation, declared
from asyncgrpo.core.packing.tree import PackedRow, pack_row, shared_positions
from asyncgrpo.core.records import TrainingSample
from asyncgrpo.core.rollout.metrics import sample_observations, staleness_by_length


def added_cost(length: int, shared: int) -> int:
    """Attention cost a sample of ``length`` tokens adds when ``shared`` positions exist.

    Example:
        >>> added_cost(5, 0), added_cost(5, 2)
        (15, 12)
    """
    return (length * (length + 1) - shared * (shared + 1)) // 2


def attention_cost(position_ids: np.ndarray) -> int:
    """Cost of a packed row: ``sum(position_ids + 1)`` (query-key pairs)."""
    return int((np.asarray(position_ids, dtype=np.int64) + 1).sum())


@attrs.frozen
class RowPlan:
    """Samples of one row (indices into the planner's input), its forwarded tokens (shared
    tokens once), its loss terms (trained tokens summed over its samples) and its attention
    cost (query-key pairs)."""

    samples: tuple[int, ...] = ()
    tokens: int = 0
    cost: int = 0
    loss_terms: int = 0


@attrs.frozen
class StepPlan:
    """The micro-batches of one step.

    Attributes:
        micro_batches: each a tuple of ``num_processes`` rows (a row may be empty when a
            micro-batch holds fewer samples than processes).
        dropped_oversize: indices of samples longer than ``token_budget``.
        leftover: indices of samples that did not fit this step, in order.
    """

    micro_batches: tuple[tuple[RowPlan, ...], ...]
    dropped_oversize: tuple[int, ...]
    leftover: tuple[int, ...]

    @property
    def complete(self) -> bool:
        """True when the step filled up (some sample was left for the next step)."""
        return bool(self.leftover)

    @property
    def placed(self) -> tuple[int, ...]:
        """Indices of the samples placed in the step, row by row."""
        return tuple(i for mb in self.micro_batches for row in mb for i in row.samples)


@attrs.frozen(eq=False)
class PlanState:
    """A step planned one sample at a time: :func:`add_sample` places the next sample.

    Placement is order-preserving, so the samples a step takes are always a prefix of those
    added: once no row of the last micro-batch takes a sample the step is ``full`` and every
    later sample is left for the next step without being looked at. Adding a sample costs a
    look at the open micro-batch's rows only, whatever came before; folding
    :func:`add_sample` over samples gives exactly :func:`plan_step`'s plan.

    Attributes:
        token_budget, num_processes, gradient_accumulation_steps: as in :func:`plan_step`.
        closed: finished micro-batches.
        rows: the open micro-batch, one row per process.
        row_groups: group ids held by each open row.
        row_tokens: token arrays of each open row's samples (for prefix sharing).
        placed: samples placed so far (they are the first ``placed`` added).
        full: True once a sample was left over; the step takes no more.
    """

    token_budget: int
    num_processes: int = 1
    gradient_accumulation_steps: int = 1
    closed: tuple[tuple[RowPlan, ...], ...] = ()
    rows: tuple[RowPlan, ...] = ()
    row_groups: tuple[frozenset[int], ...] = ()
    row_tokens: tuple[tuple[np.ndarray, ...], ...] = ()
    placed: int = 0
    full: bool = False

    def __attrs_post_init__(self) -> None:
        if self.token_budget < 1 or self.num_processes < 1 or self.gradient_accumulation_steps < 1:
            raise ValueError(
                "plan_step: token_budget, num_processes and gradient_accumulation_steps must "
                "be >= 1"
            )
        if not self.rows:
            empty = _empty_micro_batch(self.num_processes)
            object.__setattr__(self, "rows", empty[0])
            object.__setattr__(self, "row_groups", empty[1])
            object.__setattr__(self, "row_tokens", empty[2])

    @property
    def micro_batches(self) -> tuple[tuple[RowPlan, ...], ...]:
        """The closed micro-batches and the open one if it holds a sample."""
        if any(row.samples for row in self.rows):
            return (*self.closed, self.rows)
        return self.closed


def _empty_micro_batch(
    num_processes: int,
) -> tuple[tuple[RowPlan, ...], tuple[frozenset[int], ...], tuple[tuple[np.ndarray, ...], ...]]:
    return (RowPlan(),) * num_processes, (frozenset(),) * num_processes, ((),) * num_processes


def _choose_row(
    state: PlanState, tokens: np.ndarray, loss_terms: int, group_id: int
) -> tuple[int, int, int] | None:
    """(cost after, row, new tokens) of the row the sample goes to, or None when the
    micro-batch closes (rules 2 to 4 of the module docstring)."""
    options: list[tuple[int, int, int]] = []  # (cost after, row, new tokens)
    home: list[tuple[int, int, int]] = []
    has_home = False
    for r, row in enumerate(state.rows):
        is_home = group_id in state.row_groups[r]
        has_home = has_home or is_home
        shared = max((shared_positions(tokens, t) for t in state.row_tokens[r]), default=0)
        new_tokens = len(tokens) - shared
        if max(row.tokens + new_tokens, row.loss_terms + loss_terms) > state.token_budget:
            continue
        option = (row.cost + added_cost(len(tokens), shared), r, new_tokens)
        options.append(option)
        if is_home:
            home.append(option)
    if home:
        return min(home)
    best = min(options, default=None)
    if best is None or not has_home or any(not row.samples for row in state.rows):
        return best
    most_loaded = max(row.cost for row in state.rows)
    return best if best[0] <= most_loaded else None  # the full-home-row rule


def _placed_in(state: PlanState, sample: TrainingSample) -> PlanState | None:
    tokens = sample.sequence.input_ids
    loss_terms = sample.sequence.num_trained
    choice = _choose_row(state, tokens, loss_terms, sample.group_id)
    if choice is None:
        return None
    cost_after, r, new_tokens = choice
    row = state.rows[r]
    index = state.placed
    return attrs.evolve(
        state,
        rows=_replace(
            state.rows,
            r,
            RowPlan(
                (*row.samples, index),
                row.tokens + new_tokens,
                cost_after,
                row.loss_terms + loss_terms,
            ),
        ),
        row_groups=_replace(state.row_groups, r, state.row_groups[r] | {sample.group_id}),
        row_tokens=_replace(state.row_tokens, r, (*state.row_tokens[r], tokens)),
        placed=index + 1,
    )


def _replace(items: tuple, index: int, item: object) -> tuple:
    return (*items[:index], item, *items[index + 1 :])


def add_sample(state: PlanState, sample: TrainingSample) -> PlanState:
    """The plan after the next sample (which fits ``token_budget``) is offered to the step.

    It goes to a row of the open micro-batch (rules in the module docstring); if none takes it,
    the micro-batch closes and the sample opens the next one; if that was the step's last
    micro-batch, the step is ``full`` and the sample is left over. The new sample's index is
    ``state.placed`` (samples are numbered in the order added).
    """
    if state.full:
        return state
    tokens = sample.sequence.input_ids
    if len(tokens) > state.token_budget:
        raise ValueError(
            f"add_sample: a sample of {len(tokens)} tokens exceeds token_budget "
            f"({state.token_budget}); drop it before planning"
        )
    placed = _placed_in(state, sample)
    if placed is not None:
        return placed
    closed = (*state.closed, state.rows)
    if len(closed) == state.gradient_accumulation_steps:
        return attrs.evolve(state, full=True)
    rows, groups, row_tokens = _empty_micro_batch(state.num_processes)
    opened = attrs.evolve(state, closed=closed, rows=rows, row_groups=groups, row_tokens=row_tokens)
    placed = _placed_in(opened, sample)
    assert placed is not None  # a sample within the budget fits an empty row
    return placed


def plan_step(
    samples: Sequence[TrainingSample],
    token_budget: int,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
) -> StepPlan:
    """Place ``samples`` into one step's micro-batches (rules in the module docstring).

    Args:
        samples: candidates in arrival order.
        token_budget: per row, the most forwarded tokens (shared tokens counted once) and
            the most loss terms (trained tokens summed over the row's samples).
        num_processes: rows per micro-batch.
        gradient_accumulation_steps: micro-batches per step.

    Example:
        >>> from asyncgrpo.core.records import TrainingSequence
        >>> def s(tokens, group):
        ...     seq = TrainingSequence(tokens, [0] + [1] * (len(tokens) - 1),
        ...                            [0.0] + [-1.0] * (len(tokens) - 1))
        ...     return TrainingSample(seq, 1.0, 0, group, group, group, "r")
        >>> plan = plan_step([s([1, 2, 3, 4], 0), s([1, 2, 3, 5], 0), s([9] * 9, 1)],
        ...                  token_budget=8)
        >>> [row.samples for mb in plan.micro_batches for row in mb], plan.dropped_oversize
        ([(0, 1)], (2,))
    """
    state = PlanState(token_budget, num_processes, gradient_accumulation_steps)
    fitting: list[int] = []  # input index of each sample offered to the plan
    dropped: list[int] = []
    for index, sample in enumerate(samples):
        if len(sample.sequence.input_ids) > token_budget:
            dropped.append(index)
            continue
        fitting.append(index)
        state = add_sample(state, sample)
    micro_batches = tuple(
        tuple(attrs.evolve(row, samples=tuple(fitting[i] for i in row.samples)) for row in mb)
        for mb in state.micro_batches
    )
    return StepPlan(micro_batches, tuple(dropped), tuple(fitting[state.placed :]))


BATCH_METRICS: Mapping[str, Aggregation] = FrozenMap(
    {
        **dict.fromkeys(
            (
                "batch/forwarded_tokens_per_step",
                "batch/trained_tokens_per_step",
                "batch/samples_per_step",
                "batch/groups_per_step",
                "batch/microbatches_per_step",
                "batch/masked_token_frac",
                "batch/samples_per_row",
                "batch/row_tokens_mean",
                "batch/row_fill_frac",
                "batch/row_imbalance",
                "batch/packing_ratio",
                "batch/pad_frac",
            ),
            Aggregation.MEAN,
        ),
        "batch/row_tokens_max": Aggregation.MAX,
        "batch/dropped_oversize_count": Aggregation.SUM,
    }
)
"""How each metric of :func:`batch_metrics` aggregates over a window's steps."""


def batch_metrics(
    micro_batches: Sequence[Sequence[PackedRow | None]],
    token_budget: int,
    dropped_oversize: int = 0,
) -> dict[str, float]:
    """The ``batch/*`` metrics of TRL's AsyncGRPOTrainer of one step, from its packed rows.

    Args:
        micro_batches: per micro-batch, one packed row per process (``None`` for an empty
            row).
        token_budget: tokens per row, for ``batch/row_fill_frac``.
        dropped_oversize: samples the planner dropped as longer than the budget.

    Per-step values are sums over the step; per-row values are means over its rows.

    ``batch/masked_token_frac`` counts what TRL's AsyncGRPOTrainer (documentation) counts:
    of the forwarded tokens, the share that is not trained, with tokens counted as the
    documentation's words count them, per sample (a sample's forwarded tokens are all its
    tokens, prompt and tool results included; its trained tokens are those the loss is taken
    over). So it is ``1 - sum(trained) / sum(tokens)`` over the step's samples, as
    ``sample/trained_tokens_mean`` over ``sample/forwarded_tokens_mean`` has it, and packing
    does not move it: a prompt shared by a group counts once per sample.
    """
    rows = [row for mb in micro_batches for row in mb]
    filled = [row for row in rows if row is not None]
    forwarded = sum(row.num_tokens for row in filled)
    unpacked = sum(row.unpacked_tokens for row in filled)
    row_tokens = [0 if row is None else row.num_tokens for row in rows]
    imbalance: list[float] = []
    padding: list[float] = []
    for mb in micro_batches:
        costs = [0 if row is None else attention_cost(row.position_ids) for row in mb]
        lengths = [0 if row is None else row.num_tokens for row in mb]
        if max(costs) > 0:
            imbalance.append(max(costs) / float(np.mean(costs)))
        if max(lengths) > 0:
            padding.append(1.0 - sum(lengths) / (len(lengths) * max(lengths)))
    samples = [sample for row in filled for sample in row.samples]
    sample_tokens = sum(len(s.sequence) for s in samples)
    sample_trained = sum(s.sequence.num_trained for s in samples)
    return {
        "batch/forwarded_tokens_per_step": float(forwarded),
        "batch/trained_tokens_per_step": float(sum(len(row.target_ids) for row in filled)),
        "batch/samples_per_step": float(len(samples)),
        "batch/groups_per_step": float(len({s.group_id for s in samples})),
        "batch/microbatches_per_step": float(len(micro_batches)),
        "batch/masked_token_frac": 1.0 - sample_trained / sample_tokens if samples else 0.0,
        "batch/samples_per_row": len(samples) / len(rows) if rows else 0.0,
        "batch/row_tokens_mean": float(np.mean(row_tokens)) if rows else 0.0,
        "batch/row_tokens_max": float(max(row_tokens, default=0)),
        "batch/row_fill_frac": float(np.mean(row_tokens)) / token_budget if rows else 0.0,
        "batch/row_imbalance": float(np.mean(imbalance)) if imbalance else 1.0,
        "batch/packing_ratio": unpacked / forwarded if forwarded else 1.0,
        "batch/pad_frac": float(np.mean(padding)) if padding else 0.0,
        "batch/dropped_oversize_count": float(dropped_oversize),
    }


@attrs.frozen
class PackedStep:
    """A step taken off the queue, packed for the learner.

    Attributes:
        micro_batches: per micro-batch, one packed row per process (``None`` for a process
            without a sample), each without its samples' sampler tables, which the learner
            reads from the row's own trained-token arrays.
    """

    micro_batches: tuple[tuple[PackedRow | None, ...], ...]

    @property
    def rows(self) -> list[PackedRow]:
        """The rows that hold samples, micro-batch by micro-batch."""
        return [row for mb in self.micro_batches for row in mb if row is not None]

    @property
    def forwarded_tokens(self) -> int:
        """Tokens the learner forwards for the step, shared prefixes counted once."""
        return sum(row.num_tokens for row in self.rows)


def pack_step(micro_batches: Sequence[Sequence[Sequence[TrainingSample]]]) -> PackedStep:
    """Pack each row of a step (per micro-batch, one tuple of samples per process) with
    :func:`~asyncgrpo.core.packing.tree.pack_row`; an empty row becomes ``None``."""
    return PackedStep(
        tuple(
            tuple(pack_row(list(row)).without_sample_tables() if row else None for row in mb)
            for mb in micro_batches
        )
    )


def step_observations(
    step: PackedStep, version: int, now: float, token_budget: int, max_completion_length: int
) -> list[Observation]:
    """The ``sample/*`` and ``batch/*`` metrics of a step the trainer takes.

    Args:
        step: the packed step.
        version: the policy version being trained, for ``sample/staleness_*``.
        now: ``time.monotonic()`` when the step was taken, for ``sample/time_in_queue_s``.
        token_budget: tokens per row, for ``batch/row_fill_frac``.
        max_completion_length: the config's, for the staleness by completion length
            (:func:`~asyncgrpo.core.rollout.metrics.staleness_by_length`).

    ``batch/dropped_oversize_count`` is left to the step queue, which counts what it drops.
    """
    samples = [sample for row in step.rows for sample in row.samples]
    return [
        *sample_observations(samples, version, now),
        *staleness_by_length(samples, version, max_completion_length),
        *(
            declared(name, value, 1.0, BATCH_METRICS)
            for name, value in batch_metrics(step.micro_batches, token_budget).items()
            if name != "batch/dropped_oversize_count"
        ),
    ]
