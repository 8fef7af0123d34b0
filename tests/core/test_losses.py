"""Losses against independent numpy references: log-probs, gradients, normalisation, metrics."""

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from micro_batch_loss import policy_loss

from asyncgrpo.core.loss.inputs import LossConfig, SamplerTopK
from asyncgrpo.core.loss.losses import clipped_surrogate, normalize_loss, token_log_probs
from asyncgrpo.core.loss.metrics import LOSS_METRICS, loss_metrics
from asyncgrpo.core.metrics import MetricWindow, declared, record, summarize

LOSSES = settings(deadline=None, max_examples=60)


def ref_log_softmax(logits: np.ndarray, temperature: float, candidates: np.ndarray) -> np.ndarray:
    z = np.where(candidates, logits / temperature, -np.inf)
    top = z.max(axis=-1, keepdims=True)
    return z - top - np.log(np.exp(z - top).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class Case:
    """A float64 micro-batch with a sampler that differs from the policy."""

    logits: np.ndarray
    candidates: np.ndarray
    masked: bool
    targets: np.ndarray
    sampler_logp: np.ndarray
    topk_ids: np.ndarray
    topk_logp: np.ndarray
    topk_valid: np.ndarray
    advantages: np.ndarray
    sample_index: np.ndarray
    config: LossConfig

    @property
    def n(self) -> int:
        return self.logits.shape[0]

    def policy_logp_all(self) -> np.ndarray:
        return ref_log_softmax(self.logits, self.config.temperature, self.candidates)

    def policy_logp(self) -> np.ndarray:
        return self.policy_logp_all()[np.arange(self.n), self.targets]

    def ratio(self) -> np.ndarray:
        return np.exp(self.policy_logp() - self.sampler_logp)

    def topk_ratio(self) -> np.ndarray:
        pi = np.exp(np.take_along_axis(self.policy_logp_all(), np.maximum(self.topk_ids, 0), 1))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.topk_valid, pi / np.exp(self.topk_logp), 0.0)

    def topk(self, rows: slice = slice(None)) -> SamplerTopK:
        return SamplerTopK(
            torch.tensor(self.topk_ids[rows]),
            torch.tensor(self.topk_logp[rows]),
            torch.tensor(self.topk_valid[rows]),
        )

    def run(
        self, global_tokens: int | None = None, ga: int = 1, rows: slice = slice(None)
    ) -> tuple[object, np.ndarray]:
        logits = torch.tensor(self.logits[rows], requires_grad=True)
        out = policy_loss(
            logits,
            torch.tensor(self.targets[rows]),
            torch.tensor(self.sampler_logp[rows]),
            torch.tensor(self.advantages[rows]),
            torch.tensor(self.sample_index[rows]),
            config=self.config,
            num_trained_tokens_global=self.n if global_tokens is None else global_tokens,
            gradient_accumulation_steps=ga,
            candidate_mask=torch.tensor(self.candidates[rows]) if self.masked else None,
            topk=self.topk(rows),
        )
        (grad,) = torch.autograd.grad(out.loss, logits)
        return out, grad.numpy()

    def away_from_boundaries(self) -> bool:
        """No ratio within rounding of a keep-range or trust-region bound."""
        bounds = np.array([*keep_range(self.config), *trust_region(self.config)])
        ratios = np.concatenate([self.ratio(), self.topk_ratio()[self.topk_valid]])
        return bool(np.all(np.abs(ratios[:, None] - bounds[None, :]) > 1e-9))


@st.composite
def cases(draw, score_centering=None, max_n=20) -> Case:
    n = draw(st.integers(1, max_n))
    v = draw(st.integers(3, 12))
    logits = draw(arrays(np.float64, (n, v), elements=st.floats(-4, 4)))
    noise = draw(arrays(np.float64, (n, v), elements=st.floats(-1.5, 1.5)))
    targets = draw(arrays(np.int64, n, elements=st.integers(0, v - 1)))
    masked = draw(st.booleans())
    candidates = draw(arrays(np.bool_, (n, v))) if masked else np.ones((n, v), dtype=bool)
    candidates[np.arange(n), targets] = True
    config = LossConfig(
        temperature=draw(st.floats(0.5, 2.0)),
        epsilon=draw(st.floats(0.01, 0.5)),
        epsilon_high=draw(st.one_of(st.none(), st.floats(0.01, 0.5))),
        vllm_importance_sampling_clip_min=draw(st.floats(0.3, 0.95)),
        vllm_importance_sampling_clip_max=draw(st.floats(1.05, 4.0)),
        score_centering=draw(st.booleans()) if score_centering is None else score_centering,
    )
    sampler_all = ref_log_softmax(logits / config.temperature + noise, 1.0, candidates)
    k = draw(st.integers(1, v))
    order = np.argsort(-sampler_all, axis=1, kind="stable")[:, :k]
    counts = draw(arrays(np.int64, n, elements=st.integers(0, k)))
    valid = np.arange(k)[None, :] < counts[:, None]
    return Case(
        logits=logits,
        candidates=candidates,
        masked=masked,
        targets=targets,
        sampler_logp=sampler_all[np.arange(n), targets],
        topk_ids=np.where(valid, order, -1),
        topk_logp=np.where(valid, np.take_along_axis(sampler_all, order, 1), np.nan),
        topk_valid=valid,
        advantages=draw(arrays(np.float64, n, elements=st.one_of(st.just(0.0), st.floats(-2, 2)))),
        sample_index=draw(arrays(np.int64, n, elements=st.integers(0, 4))),
        config=config,
    )


def keep_range(config: LossConfig) -> tuple[float, float]:
    return config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max


def trust_region(config: LossConfig) -> tuple[float, float]:
    high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    return 1.0 - config.epsilon, 1.0 + high


def f(ratio: np.ndarray, config: LossConfig) -> np.ndarray:
    low, high = keep_range(config)
    return np.where((ratio >= low) & (ratio <= high), ratio, 0.0)


def score(case: Case, row: int, token: int) -> np.ndarray:
    """d log pi(token) / d logits[row] in closed form: (e_token - pi) / T."""
    pi = np.exp(case.policy_logp_all()[row])
    return (np.eye(pi.size)[token] - pi) / case.config.temperature


# log-probs and entropy


@LOSSES
@given(cases())
def test_log_probs_and_entropy_match_a_manual_log_softmax(case: Case) -> None:
    v = case.logits.shape[1]
    full = np.broadcast_to(np.arange(v), (case.n, v)).copy()
    tokens = token_log_probs(
        torch.tensor(case.logits),
        torch.tensor(case.targets),
        case.config.temperature,
        torch.tensor(case.candidates) if case.masked else None,
        SamplerTopK(torch.tensor(full), torch.zeros(case.n, v), torch.ones(case.n, v).bool()),
    )
    expected = case.policy_logp_all()
    np.testing.assert_allclose(tokens.logp.numpy(), case.policy_logp(), rtol=1e-12, atol=1e-12)
    whole = tokens.topk_logp.numpy()
    assert np.all(np.isneginf(whole[~case.candidates]))
    np.testing.assert_allclose(
        whole[case.candidates], expected[case.candidates], rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(np.exp(whole).sum(axis=1), 1.0, rtol=1e-12, atol=1e-12)
    entropy = [-sum(math.exp(x) * x for x in row[row > -np.inf]) for row in expected]
    np.testing.assert_allclose(tokens.entropy.numpy(), entropy, atol=1e-12)


@LOSSES
@given(cases())
def test_topk_log_probs_are_gathered_and_minus_inf_at_padding(case: Case) -> None:
    tokens = token_log_probs(
        torch.tensor(case.logits),
        torch.tensor(case.targets),
        case.config.temperature,
        torch.tensor(case.candidates) if case.masked else None,
        case.topk(),
    )
    got = tokens.topk_logp.numpy()
    expected = np.take_along_axis(case.policy_logp_all(), np.maximum(case.topk_ids, 0), 1)
    assert np.all(np.isneginf(got[~case.topk_valid]))
    np.testing.assert_allclose(
        got[case.topk_valid], expected[case.topk_valid], rtol=1e-12, atol=1e-12
    )


def test_entropy_is_detached_and_bfloat16_logits_compute_in_float32() -> None:
    logits = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
    tokens = token_log_probs(logits, torch.tensor([0, 1, 2]), 0.7)
    assert tokens.logp.dtype == torch.float32
    assert tokens.logp.requires_grad
    assert not tokens.entropy.requires_grad


# score centering


@LOSSES
@given(cases(score_centering=True), st.integers(0, 30), st.integers(1, 4))
def test_score_centering_gradient_equals_the_analytic_estimator(case, extra, ga) -> None:
    assume(case.away_from_boundaries())
    global_tokens = case.n + extra
    _, grad = case.run(global_tokens, ga)
    config = case.config
    own_weight = f(case.ratio(), config)
    expected = np.zeros_like(case.logits)
    for i in range(case.n):
        g = own_weight[i] * score(case, i, case.targets[i])
        for j in np.flatnonzero(case.topk_valid[i]):
            mu = np.exp(case.topk_logp[i, j])
            if mu > 0:
                pi = np.exp(case.policy_logp_all()[i, case.topk_ids[i, j]])
                g -= mu * f(np.array(pi / mu), config) * score(case, i, case.topk_ids[i, j])
        expected[i] = -case.advantages[i] * g / (global_tokens * ga)
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad, expected, rtol=1e-9, atol=1e-12)


@LOSSES
@given(cases(score_centering=True))
def test_score_centering_is_reinforce_when_sampler_and_policy_agree(case: Case) -> None:
    v = case.logits.shape[1]
    policy_all = case.policy_logp_all()
    on_policy = Case(
        **{
            **case.__dict__,
            "sampler_logp": case.policy_logp(),
            "topk_ids": np.broadcast_to(np.arange(v), (case.n, v)).copy(),
            "topk_logp": policy_all,
            "topk_valid": np.ones((case.n, v), dtype=bool),
        }
    )
    _, grad = on_policy.run()
    reinforce = np.stack(
        [-case.advantages[i] * score(case, i, case.targets[i]) / case.n for i in range(case.n)]
    )
    np.testing.assert_allclose(grad, reinforce, rtol=1e-9, atol=1e-12)


@LOSSES
@given(
    arrays(np.float64, st.integers(3, 12), elements=st.floats(-4, 4)),
    st.floats(-1.5, 1.5),
    st.floats(-2, 2),
    st.floats(0.3, 0.95),
    st.floats(1.05, 3.0),
)
def test_score_centering_has_zero_expected_gradient_for_a_constant_advantage(
    logits, tilt, advantage, clip_min, clip_max
) -> None:
    """E_{o~mu} of the estimator vanishes when the top-K is the whole vocabulary, dropped
    targets included: their own term is 0 but their centering term still counts."""
    v = logits.size
    sampler = ref_log_softmax(logits + tilt * np.arange(v) / v, 1.0, np.ones(v, dtype=bool))
    rows = torch.tensor(np.broadcast_to(logits, (v, v)).copy(), requires_grad=True)
    out = policy_loss(
        rows,
        torch.arange(v),
        torch.tensor(sampler),
        torch.tensor(advantage * np.exp(sampler)),
        torch.arange(v),
        config=LossConfig(
            vllm_importance_sampling_clip_min=clip_min,
            vllm_importance_sampling_clip_max=clip_max,
        ),
        num_trained_tokens_global=v,
        gradient_accumulation_steps=1,
        topk=SamplerTopK(
            torch.arange(v).expand(v, v).contiguous(),
            torch.tensor(np.broadcast_to(sampler, (v, v)).copy()),
            torch.ones(v, v, dtype=torch.bool),
        ),
    )
    (grad,) = torch.autograd.grad(out.loss, rows)
    np.testing.assert_allclose(grad.sum(0).numpy(), 0.0, atol=1e-12)


@LOSSES
@given(cases())
def test_zero_advantage_tokens_get_zero_gradient(case: Case) -> None:
    _, grad = case.run()
    assert np.all(grad[case.advantages == 0.0] == 0.0)


# clipped surrogate


@LOSSES
@given(cases(score_centering=False))
def test_clipped_surrogate_matches_a_direct_per_token_computation(case: Case) -> None:
    config = case.config
    low, high = trust_region(config)
    ratio, a = case.ratio(), case.advantages
    keep = (ratio >= keep_range(config)[0]) & (ratio <= keep_range(config)[1])
    expected = -np.where(keep, np.minimum(ratio * a, np.clip(ratio, low, high) * a), 0.0)
    got = clipped_surrogate(
        torch.tensor(case.policy_logp()),
        torch.tensor(case.sampler_logp),
        torch.tensor(a),
        config,
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


@LOSSES
@given(cases(score_centering=False), st.integers(0, 30), st.integers(1, 4))
def test_clipped_surrogate_gradient_flows_only_where_kept_and_not_clipped(case, extra, ga) -> None:
    assume(case.away_from_boundaries())
    global_tokens = case.n + extra
    out, grad = case.run(global_tokens, ga)
    config = case.config
    low, high = trust_region(config)
    ratio, a = case.ratio(), case.advantages
    kept = (ratio >= keep_range(config)[0]) & (ratio <= keep_range(config)[1])
    clipped = ((a > 0) & (ratio > high)) | ((a < 0) & (ratio < low))
    assert np.all(grad[~kept | clipped] == 0.0)
    expected = np.stack(
        [
            -a[i] * ratio[i] * score(case, i, case.targets[i]) / (global_tokens * ga)
            if kept[i] and not clipped[i]
            else np.zeros(case.logits.shape[1])
            for i in range(case.n)
        ]
    )
    np.testing.assert_allclose(grad, expected, rtol=1e-9, atol=1e-12)
    assert "sampling/sampler_mass" not in out.metrics


def test_a_dropped_token_with_an_overflowing_ratio_leaves_no_nan() -> None:
    logits = torch.tensor([[80.0, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    for centering in (False, True):
        out = policy_loss(
            logits,
            torch.tensor([0, 2]),
            torch.tensor([-200.0, -1.0]),
            torch.tensor([1.0, 1.0]),
            torch.tensor([0, 1]),
            config=LossConfig(score_centering=centering),
            num_trained_tokens_global=2,
            gradient_accumulation_steps=1,
            candidate_mask=torch.tensor([[True, True, True], [True, False, False]]),
            topk=SamplerTopK(
                torch.tensor([[0, 1], [0, 1]]),
                torch.tensor([[-200.0, -1.0], [-0.1, -5.0]]),
                torch.tensor([[True, True], [True, True]]),
            ),
        )
        (grad,) = torch.autograd.grad(out.loss, logits)
        assert torch.isfinite(out.loss)
        assert torch.isfinite(grad).all()
        assert out.metrics["sampling/masked_mean"] == 1.0


# normalisation


@LOSSES
@given(cases(), st.lists(st.integers(0, 20), max_size=4), st.integers(0, 10), st.integers(1, 3))
def test_splitting_a_micro_batch_with_the_same_global_count_sums_to_the_whole(
    case, cuts, extra, ga
) -> None:
    global_tokens = case.n + extra
    whole, whole_grad = case.run(global_tokens, ga)
    edges = [0, *sorted(min(c, case.n) for c in cuts), case.n]
    pieces = [case.run(global_tokens, ga, slice(a, b)) for a, b in itertools.pairwise(edges)]
    total = sum(piece.loss for piece, _ in pieces)
    np.testing.assert_allclose(total.item(), whole.loss.item(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.concatenate([g for _, g in pieces]), whole_grad, atol=1e-15)


def test_normalize_loss_divides_by_global_tokens_and_accumulation_steps() -> None:
    per_token = torch.tensor([1.0, 2.0, 3.0])
    assert normalize_loss(per_token, 10, 4).item() == pytest.approx(6.0 / 40.0)
    assert normalize_loss(torch.zeros(0), 0, 1).item() == 0.0


def test_an_empty_micro_batch_gives_zero_loss_with_grad_and_nan_metrics() -> None:
    logits = torch.zeros(0, 5, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.long)
    out = policy_loss(
        logits,
        empty,
        torch.zeros(0),
        torch.zeros(0),
        empty,
        config=LossConfig(),
        num_trained_tokens_global=7,
        gradient_accumulation_steps=2,
        topk=SamplerTopK(empty.reshape(0, 3), torch.zeros(0, 3), torch.zeros(0, 3).bool()),
    )
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert out.num_tokens == 0
    assert all(math.isnan(v) for v in out.metrics.values())
    assert "sampling/sampler_mass" in out.metrics


# metrics


def expected_metrics(case: Case) -> dict[str, float]:
    config = case.config
    low, high = trust_region(config)
    logp = case.policy_logp()
    ratio = case.ratio()
    difference = np.abs(logp - case.sampler_logp)
    kept = (ratio >= keep_range(config)[0]) & (ratio <= keep_range(config)[1])
    below, above = ratio < low, ratio > high
    completions = [case.sample_index == s for s in np.unique(case.sample_index)]
    logp_all = np.where(case.candidates, case.policy_logp_all(), 0.0)
    entropy = -np.where(case.candidates, np.exp(logp_all) * logp_all, 0.0).sum(1)
    metrics = {
        "sampling/importance_sampling_ratio/min": ratio.min(),
        "sampling/importance_sampling_ratio/mean": ratio.mean(),
        "sampling/importance_sampling_ratio/max": ratio.max(),
        "sampling/sampling_logp_difference/mean": difference.mean(),
        "sampling/sampling_logp_difference/max": difference.max(),
        "sampling/masked_mean": 1.0 - kept.mean(),
        "entropy": entropy.mean(),
        "clip_ratio/region_mean": (below | above).mean(),
        "clip_ratio/low_mean": below.mean(),
        "clip_ratio/low_min": min(below[c].mean() for c in completions),
        "clip_ratio/high_mean": above.mean(),
        "clip_ratio/high_max": max(above[c].mean() for c in completions),
    }
    if config.score_centering:
        mu = np.where(case.topk_valid, np.exp(np.nan_to_num(case.topk_logp)), 0.0)
        metrics["sampling/sampler_mass"] = mu.sum(1).mean()
    return metrics


@LOSSES
@given(cases())
def test_metrics_equal_direct_computations(case: Case) -> None:
    assume(case.away_from_boundaries())
    out, _ = case.run()
    expected = expected_metrics(case)
    assert out.metrics.keys() == expected.keys()
    for name, amount in expected.items():
        assert out.metrics[name] == pytest.approx(amount, rel=1e-9, abs=1e-12), name
    assert out.num_tokens == case.n


@LOSSES
@given(cases())
def test_metrics_weighted_by_num_tokens_aggregate_to_the_whole(case: Case) -> None:
    """Recording each piece's metrics with weight num_tokens (pieces hold whole completions)
    gives the whole micro-batch's metrics."""
    order = np.argsort(case.sample_index, kind="stable")
    case = Case(
        **{
            **case.__dict__,
            **{
                name: getattr(case, name)[order]
                for name in (
                    "logits",
                    "candidates",
                    "targets",
                    "sampler_logp",
                    "topk_ids",
                    "topk_logp",
                    "topk_valid",
                    "advantages",
                    "sample_index",
                )
            },
        }
    )
    whole, _ = case.run()
    edges = [0, *np.flatnonzero(np.diff(case.sample_index)) + 1, case.n]
    window = MetricWindow()
    for a, b in itertools.pairwise(edges):
        piece, _ = case.run(rows=slice(a, b))
        window = record(
            window,
            [declared(k, v, piece.num_tokens, LOSS_METRICS) for k, v in piece.metrics.items()],
        )
    summary = summarize(window)
    for name, amount in whole.metrics.items():
        assert summary[name] == pytest.approx(amount, rel=1e-9, abs=1e-12), name


def test_loss_metrics_per_completion_extremes() -> None:
    logp = torch.zeros(5)
    sampler_logp = torch.log(torch.tensor([0.5, 1.0, 2.0, 1.0, 1.0])).neg()  # r: .5 1 2 1 1
    metrics = loss_metrics(
        logp, sampler_logp, torch.zeros(5), torch.tensor([3, 3, 8, 8, 1]), LossConfig()
    )
    assert metrics["clip_ratio/low_mean"] == pytest.approx(0.2)
    assert metrics["clip_ratio/low_min"] == 0.0
    assert metrics["clip_ratio/high_max"] == pytest.approx(0.5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(0.4)


@LOSSES
@given(
    ratios=st.lists(st.floats(0.05, 20.0), min_size=0, max_size=40),
    data=st.data(),
)
def test_masked_tokens_by_length_quarter_add_up_to_the_masked_mean(ratios, data) -> None:
    """Per quarter, the tokens dropped by the keep range and the tokens; over the quarters
    they are ``sampling/masked_mean`` times all the tokens, and a window sums them."""
    n = len(ratios)
    quarter = torch.tensor(data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n)))
    logp = torch.zeros(n, dtype=torch.float64)
    sampler_logp = -torch.log(torch.tensor(ratios, dtype=torch.float64))
    sample_index = torch.arange(n)
    metrics = loss_metrics(
        logp, sampler_logp, torch.zeros(n), sample_index, LossConfig(), length_quarter=quarter
    )
    keep = [0.5 <= r <= 5.0 for r in ratios]
    for q in range(1, 5):
        inside = [k for k, qq in zip(keep, quarter.tolist(), strict=True) if qq == q]
        assert metrics[f"sampling/length_q{q}/token_count"] == len(inside)
        assert metrics[f"sampling/length_q{q}/masked_token_count"] == inside.count(False)
    if n:
        masked = sum(
            float(metrics[f"sampling/length_q{q}/masked_token_count"]) for q in range(1, 5)
        )
        assert masked == pytest.approx(float(metrics["sampling/masked_mean"]) * n)
    window = record(
        MetricWindow(),
        [declared(name, float(v), n, LOSS_METRICS) for name, v in metrics.items()] * 2,
    )
    assert summarize(window)["sampling/length_q1/token_count"] == 2 * quarter.eq(1).sum().item()


# validation


def call(**overrides):
    args = {
        "logits": torch.zeros(2, 4),
        "target_ids": torch.tensor([0, 1]),
        "sampler_logp": torch.full((2,), -1.0),
        "advantages": torch.ones(2),
        "sample_index": torch.tensor([0, 0]),
        "config": LossConfig(),
        "num_trained_tokens_global": 2,
        "gradient_accumulation_steps": 1,
        "topk": SamplerTopK(torch.zeros(2, 1).long(), torch.zeros(2, 1), torch.ones(2, 1).bool()),
    }
    args.update(overrides)
    return policy_loss(**args)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"logits": torch.zeros(2)}, ValueError, "logits has shape"),
        ({"logits": torch.zeros(2, 4).long()}, TypeError, "logits has dtype"),
        ({"target_ids": torch.tensor([0, 1, 2])}, ValueError, "target_ids has shape"),
        ({"target_ids": torch.tensor([0, 1]).int()}, TypeError, r"target_ids .*\.long\(\)"),
        ({"sampler_logp": torch.zeros(3)}, ValueError, "sampler_logp has shape"),
        ({"advantages": torch.ones(2, 1)}, ValueError, "advantages has shape"),
        ({"sample_index": torch.zeros(2)}, TypeError, "sample_index has dtype"),
        ({"candidate_mask": torch.ones(2, 3).bool()}, ValueError, "candidate_mask has shape"),
        ({"candidate_mask": torch.ones(2, 4)}, TypeError, r"candidate_mask .*\.bool\(\)"),
        ({"topk": None}, ValueError, "score_centering=False"),
        (
            {
                "topk": SamplerTopK(
                    torch.zeros(3, 1).long(), torch.zeros(3, 1), torch.ones(3, 1).bool()
                )
            },
            ValueError,
            "topk has 3 rows",
        ),
        ({"num_trained_tokens_global": 1}, ValueError, "num_trained_tokens_global"),
        ({"gradient_accumulation_steps": 0}, ValueError, "gradient_accumulation_steps"),
    ],
)
def test_bad_inputs_name_the_argument(overrides, error, match) -> None:
    with pytest.raises(error, match=match):
        call(**overrides)


def test_bad_topk_and_config_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"topk\.logp has shape"):
        SamplerTopK(torch.zeros(2, 3).long(), torch.zeros(2, 2), torch.ones(2, 3).bool())
    with pytest.raises(TypeError, match=r"topk\.valid has dtype"):
        SamplerTopK(torch.zeros(2, 3).long(), torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="temperature"):
        LossConfig(temperature=0.0)
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_max"):
        LossConfig(vllm_importance_sampling_clip_max=0.9)
    with pytest.raises(ValueError, match="epsilon_high"):
        LossConfig(epsilon_high=-0.1)


def test_the_clipped_surrogate_needs_no_topk_and_ignores_one() -> None:
    config = LossConfig(score_centering=False)
    without, with_topk = call(config=config, topk=None), call(config=config)
    ratio = math.exp(1.0 - math.log(4.0))  # uniform policy over 4 tokens, sampler logp -1
    assert without.loss.item() == pytest.approx(-ratio)
    assert with_topk.loss.item() == without.loss.item()
    assert with_topk.metrics == without.metrics
