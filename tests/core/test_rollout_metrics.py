import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.metrics import (
    LENGTH_QUARTERS,
    MetricWindow,
    length_quarter,
    record,
    summarize,
)
from asyncgrpo.core.records import Rollout, TrainingSample, TrainingSequence, TurnRecord
from asyncgrpo.core.rollout.advantages import score_group
from asyncgrpo.core.rollout.metrics import (
    GroupFacts,
    group_observations,
    sample_observations,
    stale_drops_by_length,
    staleness_by_length,
)
from asyncgrpo.core.rollout.reconcile import reconcile_turns

EOS = 2


@st.composite
def groups(draw):
    rollouts = []
    for _ in range(draw(st.integers(2, 6))):
        turns = []
        for _ in range(draw(st.integers(1, 3))):
            out = draw(st.lists(st.integers(3, 6), min_size=1, max_size=4))
            if draw(st.booleans()):
                out.append(EOS)
            turns.append(TurnRecord([1, 1], out, [-1.0] * len(out)))
        rollouts.append(Rollout([], [t for turn in turns for t in turn.output_ids], turns))
    rewards = draw(
        st.lists(
            st.one_of(st.none(), st.sampled_from([0.0, 1.0])),
            min_size=len(rollouts),
            max_size=len(rollouts),
        )
    )
    return rollouts, rewards


@given(groups())
def test_group_metrics_match_direct_computation(case) -> None:
    rollouts, rewards = case
    r = np.array([np.nan if x is None else x for x in rewards])
    score = score_group(r)
    facts = GroupFacts(
        rollouts,
        [reconcile_turns(x.turns) for x in rollouts],
        score,
        {"f": rewards},
        {EOS},
        has_tools=True,
    )
    summary = summarize(record(MetricWindow(), group_observations(facts)))
    lengths = [len(x.completion_ids) for x in rollouts]
    assert summary["completions/mean_length"] == pytest.approx(np.mean(lengths))
    assert summary["completions/max_length"] == max(lengths)
    clipped = sum(1 for x in rollouts if x.turns[-1].output_ids[-1] != EOS)
    assert summary["completions/clipped_ratio"] == pytest.approx(clipped / len(rollouts))
    assert summary["frac_reward_zero_std"] == (0.0 if score.kept else 1.0)
    scored = r[~np.isnan(r)]
    if scored.size:
        assert summary["reward"] == pytest.approx(scored.mean())
        key = "reward_kept" if score.kept else "reward_dropped"
        assert summary[key] == pytest.approx(scored.mean())
    else:
        assert "reward" not in summary
    assert summary["rollout/turns_max"] == max(len(x.turns) for x in rollouts)
    assert summary["tools/call_frequency"] == 0.0


@given(groups(), st.integers(0, 3), st.integers(1, 3))
def test_nonfinite_rewards_are_counted_per_source_and_summed_over_groups(case, bad, repeats):
    """``rewards/<name>/nonfinite_count`` per source, 0 for a source that had none, summed over
    the groups of a window."""
    rollouts, rewards = case
    score = score_group(np.array([np.nan if x is None else x for x in rewards]))
    facts = GroupFacts(
        rollouts,
        [reconcile_turns(x.turns) for x in rollouts],
        score,
        {"f": rewards, "g": rewards},
        {EOS},
        nonfinite_rewards={"f": bad},
    )
    window = MetricWindow()
    for _ in range(repeats):
        window = record(window, group_observations(facts))
    summary = summarize(window)
    assert summary["rewards/f/nonfinite_count"] == bad * repeats
    assert summary["rewards/g/nonfinite_count"] == 0


def test_sample_metrics() -> None:
    seq = TrainingSequence([1, 2, 3, 4], [0, 0, 1, 1], [0, 0, -1.0, -1.0])
    samples = [
        TrainingSample(seq, 1.0, v, 0, 0, 0, "r", queued_at=t) for v, t in ((4, 1.0), (2, 3.0))
    ]
    summary = summarize(record(MetricWindow(), sample_observations(samples, 5, now=5.0)))
    assert summary == {
        "sample/forwarded_tokens_max": 4.0,
        "sample/forwarded_tokens_mean": 4.0,
        "sample/staleness_max": 3.0,
        "sample/staleness_mean": 2.0,
        "sample/time_in_queue_s": 3.0,
        "sample/trained_tokens_mean": 2.0,
    }
    assert sample_observations([], 0, 0.0) == []


def trained_sample(trained: int, version: int) -> TrainingSample:
    ids, mask = [0] * (trained + 1), [0] + [1] * trained
    return TrainingSample(TrainingSequence(ids, mask, [0.0] * len(ids)), 1.0, version, 0, 0, 0, "r")


samples_by_length = st.lists(
    st.tuples(st.integers(1, 600), st.integers(0, 8)).map(lambda c: trained_sample(*c)),
    max_size=12,
)


@given(st.integers(1, 4096), st.integers(1, 4096), st.integers(1, 4096))
def test_length_quarters_are_monotone_and_cover_the_completion_range(a, b, longest) -> None:
    low, high = sorted((a, b))
    assert 1 <= length_quarter(low, longest) <= length_quarter(high, longest) <= LENGTH_QUARTERS
    assert length_quarter(longest, longest) == LENGTH_QUARTERS


@given(samples_by_length, samples_by_length, st.integers(8, 12), st.integers(1, 512))
def test_staleness_and_stale_drops_by_length_add_up_to_the_steps(
    trained, dropped, version, longest
) -> None:
    """Each sample in one quarter: the quarters' staleness averages back to the step's, and a
    window's drop fraction per quarter is that quarter's drops over its drops and trained."""
    observations = [
        *sample_observations(trained, version, now=0.0),
        *staleness_by_length(trained, version, longest),
        *stale_drops_by_length(dropped, longest),
    ]
    window = summarize(record(MetricWindow(), observations))
    for quarter in range(1, LENGTH_QUARTERS + 1):
        kept = [s for s in trained if length_quarter(s.sequence.num_trained, longest) == quarter]
        lost = [s for s in dropped if length_quarter(s.sequence.num_trained, longest) == quarter]
        assert window[f"sample/length_q{quarter}/dropped_stale_count"] == len(lost)
        frac = f"sample/length_q{quarter}/dropped_stale_frac"
        if kept or lost:
            assert window[frac] == pytest.approx(len(lost) / (len(lost) + len(kept)))
        staleness = f"sample/length_q{quarter}/staleness_mean"
        assert (staleness in window) == bool(kept)
        if kept:
            assert window[staleness] == pytest.approx(
                np.mean([version - s.model_version for s in kept])
            )
    if trained:
        parts = [
            window[f"sample/length_q{q}/staleness_mean"] * n
            for q in range(1, LENGTH_QUARTERS + 1)
            if (n := sum(length_quarter(s.sequence.num_trained, longest) == q for s in trained))
        ]
        assert sum(parts) / len(trained) == pytest.approx(window["sample/staleness_mean"])
