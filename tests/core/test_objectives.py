"""Policy objectives against independent brute-force formulas.

For every registered objective: the gradient of ``per_token_loss(...).sum()`` equals the
autograd gradient of the written-out formula (Python loops over tokens and samples, float64) on
small random inputs; a deliberately wrong variant of the formula fails the same comparison
(negative control); its metrics are finite, in range and agree with the formula. TRL's two
objectives equal the functions of ``core.loss.losses`` exactly. Then the registry, the
``score_centering`` mapping and the input checks.

Adding an objective: write its reference and a wrong variant below and add one line to
``REFERENCES`` (a test fails while a registered objective has none).
"""

from __future__ import annotations

import doctest
import importlib
import itertools
import math
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, replace

import attrs
import numpy as np
import pytest
import torch
from hypothesis import Phase, assume, find, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from torch import Tensor

import asyncgrpo.core.loss.objectives as objectives_package
from asyncgrpo.core.loss.inputs import LossConfig, SamplerTopK
from asyncgrpo.core.loss.losses import clipped_surrogate, score_centered_surrogate
from asyncgrpo.core.loss.objectives import (
    OBJECTIVES,
    SETTINGS,
    SETTINGS_TYPES,
    Needs,
    Objective,
    ObjectiveSettings,
    TokenInputs,
    loss_type_from,
    objective_for,
    settings_for,
)
from asyncgrpo.core.loss.objectives.weights import TrustRegionSettings

PROPERTY = settings(deadline=None, max_examples=60)
F64 = torch.float64


# --- random cases ---------------------------------------------------------------------------


class DrawnSettings:
    """A drawn value of every declared objective setting: the references read them by name,
    and :meth:`of` is an objective's own settings record built from them (as the config builds
    it from its flat fields)."""

    def __init__(self, **values: float | None) -> None:
        self.values = values
        assert set(values) == {setting.name for setting in SETTINGS}, "draw every setting"

    def __getattr__(self, name: str) -> float | None:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"DrawnSettings(**{self.values!r})"

    @property
    def trust_region(self) -> tuple[float, float]:
        return settings_for(TrustRegionSettings, self.values).trust_region

    def of(self, objective: Objective) -> ObjectiveSettings:
        return settings_for(objective.settings_type, self.values)

    def replace(self, **changes: float | None) -> DrawnSettings:
        return DrawnSettings(**{**self.values, **changes})


@dataclass(frozen=True)
class Case:
    """A float64 call: a few samples of a few tokens each, in shuffled order."""

    logp: np.ndarray
    sampler_logp: np.ndarray
    advantages: np.ndarray
    sample_index: np.ndarray
    proximal_logp: np.ndarray | None
    topk_ids: np.ndarray
    topk_sampler_logp: np.ndarray
    topk_valid: np.ndarray
    topk_logp: np.ndarray
    settings: DrawnSettings

    @property
    def n(self) -> int:
        return self.logp.shape[0]

    def leaves(self, topk: bool) -> tuple[Tensor, Tensor | None]:
        """Fresh leaf tensors with grad: ``logp`` and (when ``topk``) ``topk_logp``."""
        logp = torch.tensor(self.logp, dtype=F64, requires_grad=True)
        topk_logp = torch.tensor(self.topk_logp, dtype=F64, requires_grad=True) if topk else None
        return logp, topk_logp

    def inputs(self, logp: Tensor, topk_logp: Tensor | None) -> TokenInputs:
        return TokenInputs(
            logp=logp,
            sampler_logp=torch.tensor(self.sampler_logp, dtype=F64),
            advantages=torch.tensor(self.advantages, dtype=F64),
            sample_index=torch.tensor(self.sample_index, dtype=torch.long),
            entropy=torch.zeros(self.n, dtype=F64),
            topk_logp=topk_logp,
            topk=self.topk() if topk_logp is not None else None,
            proximal_logp=None
            if self.proximal_logp is None
            else torch.tensor(self.proximal_logp, dtype=F64),
        )

    def topk(self) -> SamplerTopK:
        return SamplerTopK(
            torch.tensor(self.topk_ids, dtype=torch.long),
            torch.tensor(self.topk_sampler_logp, dtype=F64),
            torch.tensor(self.topk_valid),
        )

    def proximal(self, logp: Tensor) -> list[float]:
        """The proximal log-probs as floats: given, or the current policy's."""
        source = logp.detach().numpy() if self.proximal_logp is None else self.proximal_logp
        return [float(x) for x in source]

    def samples(self) -> dict[int, list[int]]:
        """Sample id to its token positions."""
        groups: dict[int, list[int]] = {}
        for t, s in enumerate(self.sample_index.tolist()):
            groups.setdefault(s, []).append(t)
        return groups


def bound_pair(low: tuple[float, float], high: tuple[float, float]):
    return st.tuples(st.floats(*low), st.floats(*high))


@st.composite
def valid_settings(draw) -> DrawnSettings:
    """Valid settings whose bounds stay away from 1 (an on-policy ratio is exactly 1)."""
    vis = draw(bound_pair((0.2, 0.95), (1.05, 6.0)))
    mis_token = draw(bound_pair((0.2, 0.95), (1.05, 6.0)))
    mis_sequence = draw(bound_pair((0.05, 0.95), (1.05, 20.0)))
    mis_geometric = draw(bound_pair((0.5, 0.99), (1.01, 2.0)))
    icepop = draw(bound_pair((0.2, 0.95), (1.05, 6.0)))
    cispo = draw(bound_pair((0.0, 0.95), (1.05, 6.0)))
    return DrawnSettings(
        epsilon=draw(st.floats(0.05, 0.5)),
        epsilon_high=draw(st.one_of(st.none(), st.floats(0.05, 0.5))),
        vllm_importance_sampling_clip_min=vis[0],
        vllm_importance_sampling_clip_max=vis[1],
        tis_token_cap=draw(st.floats(1.05, 6.0)),
        tis_sequence_cap=draw(st.floats(1.05, 20.0)),
        tis_geometric_cap=draw(st.floats(1.01, 3.0)),
        mis_token_clip_min=mis_token[0],
        mis_token_clip_max=mis_token[1],
        mis_sequence_clip_min=mis_sequence[0],
        mis_sequence_clip_max=mis_sequence[1],
        mis_geometric_clip_min=mis_geometric[0],
        mis_geometric_clip_max=mis_geometric[1],
        icepop_alpha=icepop[0],
        icepop_beta=icepop[1],
        behav_imp_weight_cap=draw(st.floats(1.05, 6.0)),
        m2po_threshold=draw(st.floats(0.001, 1.0)),
        cispo_clip_min=cispo[0],
        cispo_clip_max=cispo[1],
    )


@st.composite
def cases(draw, proximal: bool | None = None) -> Case:
    lengths = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    ids = draw(
        st.lists(st.integers(0, 1000), min_size=len(lengths), max_size=len(lengths), unique=True)
    )
    order = np.array(draw(st.permutations(range(sum(lengths)))), dtype=np.int64)
    sample_index = np.repeat(np.array(ids, dtype=np.int64), lengths)[order]
    n = sample_index.size
    sampler_logp = draw(arrays(np.float64, n, elements=st.floats(-4.0, -0.01)))
    shift = draw(arrays(np.float64, n, elements=st.floats(-1.5, 1.5)))
    logp = sampler_logp + shift
    with_proximal = draw(st.booleans()) if proximal is None else proximal
    proximal_logp = None
    if with_proximal:
        proximal_logp = logp + draw(arrays(np.float64, n, elements=st.floats(-0.8, 0.8)))
    k = draw(st.integers(1, 4))
    counts = draw(arrays(np.int64, n, elements=st.integers(0, k)))
    valid = np.arange(k)[None, :] < counts[:, None]
    topk_ids = np.where(valid, np.arange(k)[None, :], -1)
    topk_sampler = draw(arrays(np.float64, (n, k), elements=st.floats(-5.0, -0.01)))
    topk_policy = draw(arrays(np.float64, (n, k), elements=st.floats(-5.0, -0.01)))
    return Case(
        logp=logp,
        sampler_logp=sampler_logp,
        advantages=draw(arrays(np.float64, n, elements=st.one_of(st.just(0.0), st.floats(-2, 2)))),
        sample_index=sample_index,
        proximal_logp=proximal_logp,
        topk_ids=topk_ids,
        topk_sampler_logp=np.where(valid, topk_sampler, np.nan),
        topk_valid=valid,
        topk_logp=np.where(valid, topk_policy, -np.inf),
        settings=draw(valid_settings()),
    )


# --- brute force ----------------------------------------------------------------------------


class Comparisons:
    """The brute-force formulas' decisions; ``tight`` once any is within rounding of its bound,
    where float64 sums in another order could decide the other way."""

    def __init__(self) -> None:
        self.tight = False

    def _check(self, a: float, b: float) -> None:
        if math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-9 * max(1, abs(a), abs(b)):
            self.tight = True

    def le(self, a: float, b: float) -> bool:
        self._check(a, b)
        return a <= b

    def lt(self, a: float, b: float) -> bool:
        self._check(a, b)
        return a < b

    def inside(self, value: float, low: float, high: float) -> bool:
        return self.le(low, value) and self.le(value, high)


@dataclass
class Brute:
    """One written-out evaluation: the summed loss (a tensor with grad, or 0.0 when nothing
    depends on the leaves) and each token's importance weight (the metric's definition)."""

    total: Tensor | float
    weights: list[float]


Reference = Callable[[Case, Tensor, Tensor | None, Comparisons], Brute]


def ppo(q: Tensor, advantage: float, settings_: DrawnSettings, cmp: Comparisons) -> Tensor:
    """PPO's objective ``min(q A, clip(q) A)`` written out by cases (the loss is its negative)."""
    low, high = settings_.trust_region
    if advantage > 0 and cmp.lt(high, q.item()):
        return torch.tensor(high * advantage, dtype=F64)
    if advantage < 0 and cmp.lt(q.item(), low):
        return torch.tensor(low * advantage, dtype=F64)
    return q * advantage


def behaviour_ratios(c: Case, logp: Tensor, level: str) -> list[float]:
    """Each token's ``rho`` at ``level``, by loops: ratio, product or geometric mean of
    ``pi_prox / mu`` over the token's sample."""
    proximal = c.proximal(logp)
    token = [math.exp(proximal[t] - c.sampler_logp[t]) for t in range(c.n)]
    if level == "token":
        return token
    rho = [0.0] * c.n
    for members in c.samples().values():
        product = 1.0
        for t in members:
            product *= token[t]
        for t in members:
            rho[t] = product if level == "sequence" else product ** (1.0 / len(members))
    return rho


def decoupled(c: Case, logp: Tensor, weights: list[float], cmp: Comparisons) -> Brute:
    """``sum_t w_t * -ppo(q_t)`` with ``q = pi / pi_prox``."""
    proximal = c.proximal(logp)
    total: Tensor | float = 0.0
    for t in range(c.n):
        if weights[t] > 0:
            q = torch.exp(logp[t] - proximal[t])
            total = total - weights[t] * ppo(q, c.advantages[t], c.settings, cmp)
    return Brute(total, weights)


def ref_score_centering(c: Case, logp: Tensor, topk_logp: Tensor | None, cmp: Comparisons):
    s = c.settings
    low, high = s.vllm_importance_sampling_clip_min, s.vllm_importance_sampling_clip_max
    assert topk_logp is not None
    total: Tensor | float = 0.0
    weights = []
    for t in range(c.n):
        ratio = math.exp(logp[t].item() - c.sampler_logp[t])
        weight = ratio if cmp.inside(ratio, low, high) else 0.0
        weights.append(weight)
        own = weight * logp[t] if weight > 0 else 0.0
        centering: Tensor | float = 0.0
        for k in range(c.topk_ids.shape[1]):
            if c.topk_valid[t, k]:
                mu = math.exp(c.topk_sampler_logp[t, k])
                ratio_v = math.exp(topk_logp[t, k].item()) / mu
                if cmp.inside(ratio_v, low, high):
                    centering = centering + mu * ratio_v * topk_logp[t, k]
        total = total - c.advantages[t] * (own - centering)
    return Brute(total, weights)


def wrong_score_centering(c: Case, logp: Tensor, topk_logp: Tensor | None, cmp: Comparisons):
    """Negative control: the own term's weight is not detached."""
    s = c.settings
    low, high = s.vllm_importance_sampling_clip_min, s.vllm_importance_sampling_clip_max
    right = ref_score_centering(c, logp, topk_logp, cmp)
    total = right.total
    for t in range(c.n):
        ratio = torch.exp(logp[t] - c.sampler_logp[t])
        if cmp.inside(ratio.item(), low, high):
            total = total - c.advantages[t] * (ratio - ratio.detach()) * logp[t]
    return Brute(total, right.weights)


def ref_clipped_surrogate(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
    s = c.settings
    low, high = s.vllm_importance_sampling_clip_min, s.vllm_importance_sampling_clip_max
    total: Tensor | float = 0.0
    weights = []
    for t in range(c.n):
        ratio = torch.exp(logp[t] - c.sampler_logp[t])
        kept = cmp.inside(ratio.item(), low, high)
        weights.append(ratio.item() if kept else 0.0)
        if kept:
            total = total - ppo(ratio, c.advantages[t], s, cmp)
    return Brute(total, weights)


def wrong_clipped_surrogate(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
    """Negative control: the clip on the wrong side (A > 0 clipped below, A < 0 above)."""
    flipped = replace(c, advantages=-c.advantages)
    right = ref_clipped_surrogate(flipped, logp, None, cmp)
    total = -right.total if isinstance(right.total, Tensor) else 0.0
    return Brute(total, right.weights)


def truncated(level: str, cap: Callable[[DrawnSettings], float]) -> Reference:
    def reference(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
        limit = cap(c.settings)
        weights = [
            min(rho, limit) if cmp.le(rho, limit) else limit
            for rho in behaviour_ratios(c, logp, level)
        ]
        return decoupled(c, logp, weights, cmp)

    return reference


def masked(level: str, bounds: Callable[[DrawnSettings], tuple[float, float]]) -> Reference:
    def reference(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
        low, high = bounds(c.settings)
        weights = [
            rho if cmp.inside(rho, low, high) else 0.0 for rho in behaviour_ratios(c, logp, level)
        ]
        return decoupled(c, logp, weights, cmp)

    return reference


def wrong_tis_token(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
    """Negative control: the truncated weight is not detached (only visible without a proximal
    policy, where the weight is a function of the current policy)."""
    right = truncated("token", lambda s: s.tis_token_cap)(c, logp, None, cmp)
    if c.proximal_logp is not None:
        return right
    total = right.total
    for t in range(c.n):
        ratio = torch.exp(logp[t] - c.sampler_logp[t])
        if cmp.lt(ratio.item(), c.settings.tis_token_cap):
            total = total - (ratio - ratio.detach()) * c.advantages[t]
    return Brute(total, right.weights)


def wrong_tis_sequence(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
    """Negative control: the sequence weight computed per token."""
    return truncated("token", lambda s: s.tis_sequence_cap)(c, logp, None, cmp)


def wrong_tis_geometric(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
    """Negative control: the product of ratios instead of their geometric mean."""
    return truncated("sequence", lambda s: s.tis_geometric_cap)(c, logp, None, cmp)


def wrong_mis_token(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
    """Negative control: ratios above the range truncated instead of dropped."""
    s = c.settings
    weights = []
    for rho in behaviour_ratios(c, logp, "token"):
        keep = cmp.inside(rho, s.mis_token_clip_min, s.mis_token_clip_max)
        above = cmp.lt(s.mis_token_clip_max, rho)
        weights.append(rho if keep else s.mis_token_clip_max if above else 0.0)
    return decoupled(c, logp, weights, cmp)


def wrong_mis_sequence(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
    """Negative control: tokens masked one by one instead of whole samples."""
    return masked("token", lambda s: (s.mis_sequence_clip_min, s.mis_sequence_clip_max))(
        c, logp, None, cmp
    )


def wrong_mis_geometric(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
    """Negative control: one geometric mean over the whole call instead of per sample."""
    merged = replace(c, sample_index=np.zeros_like(c.sample_index))
    return masked("geometric", lambda s: (s.mis_geometric_clip_min, s.mis_geometric_clip_max))(
        merged, logp, None, cmp
    )


def wrong_icepop(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
    """Negative control: one-sided, tokens below alpha are kept."""
    return masked("token", lambda s: (0.0, s.icepop_beta))(c, logp, None, cmp)


def wrong_decoupled_ppo(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
    """Negative control: the behaviour weight truncated at the cap instead of dropped."""
    return truncated("token", lambda s: s.behav_imp_weight_cap)(c, logp, None, cmp)


def m2po_reference(trust_region_only: bool) -> Reference:
    def reference(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
        log_ratio = [logp[t].item() - c.sampler_logp[t] for t in range(c.n)]
        candidates = []
        for t in range(c.n):
            a = c.advantages[t]
            up, down = log_ratio[t] > 0.0, log_ratio[t] < 0.0  # computed as the code does
            if not trust_region_only or (a > 0 and up) or (a < 0 and down):
                candidates.append(t)
        second = {t: log_ratio[t] ** 2 for t in candidates}
        kept = list(candidates)
        while kept and cmp.lt(c.settings.m2po_threshold, sum(second[t] for t in kept) / len(kept)):
            largest = max(kept, key=lambda t: (second[t], -t))
            kept.remove(largest)
        masked_out = set(candidates) - set(kept)
        total: Tensor | float = 0.0
        weights = []
        for t in range(c.n):
            if t in masked_out:
                weights.append(0.0)
                continue
            ratio = torch.exp(logp[t] - c.sampler_logp[t])
            weights.append(ratio.item())
            total = total - ratio * c.advantages[t]
        return Brute(total, weights)

    return reference


def cispo_reference(detach: bool) -> Reference:
    def reference(c: Case, logp: Tensor, _: Tensor | None, cmp: Comparisons) -> Brute:
        low, high = c.settings.cispo_clip_min, c.settings.cispo_clip_max
        total: Tensor | float = 0.0
        weights = []
        for t in range(c.n):
            ratio = torch.exp(logp[t] - c.sampler_logp[t])
            if cmp.lt(ratio.item(), low):
                weight = torch.tensor(low, dtype=F64)
            elif cmp.lt(high, ratio.item()):
                weight = torch.tensor(high, dtype=F64)
            else:
                weight = ratio.detach() if detach else ratio
            weights.append(weight.item())
            total = total - weight * c.advantages[t] * logp[t]
        return Brute(total, weights)

    return reference


@dataclass(frozen=True)
class Expected:
    """An objective's tests: its brute-force reference, a deliberately wrong variant of it (the
    negative control), and the needs it must declare."""

    reference: Reference
    wrong: Reference
    needs: frozenset[str] = frozenset()


REFERENCES: dict[str, Expected] = {
    "score_centering": Expected(
        ref_score_centering, wrong_score_centering, frozenset({"sampler_topk"})
    ),
    "clipped_surrogate": Expected(ref_clipped_surrogate, wrong_clipped_surrogate),
    "tis_token": Expected(truncated("token", lambda s: s.tis_token_cap), wrong_tis_token),
    "tis_sequence": Expected(
        truncated("sequence", lambda s: s.tis_sequence_cap),
        wrong_tis_sequence,
        frozenset({"whole_samples"}),
    ),
    "tis_geometric": Expected(
        truncated("geometric", lambda s: s.tis_geometric_cap),
        wrong_tis_geometric,
        frozenset({"whole_samples"}),
    ),
    "mis_token": Expected(
        masked("token", lambda s: (s.mis_token_clip_min, s.mis_token_clip_max)), wrong_mis_token
    ),
    "mis_sequence": Expected(
        masked("sequence", lambda s: (s.mis_sequence_clip_min, s.mis_sequence_clip_max)),
        wrong_mis_sequence,
        frozenset({"whole_samples"}),
    ),
    "mis_geometric": Expected(
        masked("geometric", lambda s: (s.mis_geometric_clip_min, s.mis_geometric_clip_max)),
        wrong_mis_geometric,
        frozenset({"whole_samples"}),
    ),
    "icepop": Expected(masked("token", lambda s: (s.icepop_alpha, s.icepop_beta)), wrong_icepop),
    "decoupled_ppo": Expected(
        masked("token", lambda s: (0.0, s.behav_imp_weight_cap)), wrong_decoupled_ppo
    ),
    "m2po": Expected(
        m2po_reference(trust_region_only=True),
        m2po_reference(trust_region_only=False),
        frozenset({"batch_coupled"}),
    ),
    "cispo": Expected(cispo_reference(detach=True), cispo_reference(detach=False)),
}
"""Each registered objective's tests."""


# --- the comparison -------------------------------------------------------------------------


@dataclass
class Comparison:
    """An objective against a reference on one case."""

    tight: bool
    matches: bool
    loss: Tensor
    brute: Brute


def gradients(total: Tensor | float, leaves: list[Tensor]) -> list[np.ndarray]:
    if not isinstance(total, Tensor) or not total.requires_grad:
        return [np.zeros(leaf.shape) for leaf in leaves]
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return [
        np.zeros(leaf.shape) if g is None else g.numpy()
        for g, leaf in zip(grads, leaves, strict=True)
    ]


def compare(objective: Objective, reference: Reference, case: Case) -> Comparison:
    topk = objective.needs.sampler_topk
    logp, topk_logp = case.leaves(topk)
    loss = objective.per_token_loss(case.inputs(logp, topk_logp), case.settings.of(objective))
    leaves = [logp] + ([topk_logp] if topk_logp is not None else [])
    got = gradients(loss.sum(), leaves)
    ref_logp, ref_topk_logp = case.leaves(topk)
    cmp = Comparisons()
    brute = reference(case, ref_logp, ref_topk_logp, cmp)
    expected = gradients(brute.total, [ref_logp] + ([ref_topk_logp] if topk else []))
    total = float(brute.total.detach()) if isinstance(brute.total, Tensor) else brute.total
    matches = all(
        np.allclose(g, e, rtol=1e-9, atol=1e-12) and np.all(np.isfinite(g))
        for g, e in zip(got, expected, strict=True)
    ) and math.isclose(float(loss.sum().detach()), total, rel_tol=1e-9, abs_tol=1e-12)
    return Comparison(cmp.tight, matches, loss.detach(), brute)


NAMES = sorted(OBJECTIVES)


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(case=cases())
def test_gradient_equals_the_brute_force_formula(name: str, case: Case) -> None:
    result = compare(OBJECTIVES[name], REFERENCES[name].reference, case)
    assume(not result.tight)
    assert result.matches


@pytest.mark.parametrize("name", NAMES)
def test_negative_control_a_wrong_formula_is_caught(name: str) -> None:
    """The comparison above fails for the deliberately wrong variant on some case."""
    objective, expected = OBJECTIVES[name], REFERENCES[name]
    right, wrong = expected.reference, expected.wrong

    def caught(case: Case) -> bool:
        correct, broken = compare(objective, right, case), compare(objective, wrong, case)
        return not correct.tight and not broken.tight and correct.matches and not broken.matches

    search = settings(max_examples=2000, database=None, deadline=None, phases=[Phase.generate])
    find(cases(), caught, settings=search)


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(case=cases())
def test_metrics_are_finite_in_range_and_match_the_formula(name: str, case: Case) -> None:
    objective = OBJECTIVES[name]
    result = compare(objective, REFERENCES[name].reference, case)
    assume(not result.tight)
    logp, topk_logp = case.leaves(objective.needs.sampler_topk)
    metrics = objective.metrics(case.inputs(logp, topk_logp), case.settings.of(objective))
    assert metrics, "every objective reports metrics"
    assert all(key.startswith("objective/") for key in metrics)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    for key, v in metrics.items():
        if key.endswith("_fraction"):
            assert 0.0 <= v <= 1.0, key
    weights = result.brute.weights
    assert metrics["objective/is_weight_mean"] == pytest.approx(np.mean(weights), 1e-9, 1e-12)
    assert metrics["objective/is_weight_max"] == pytest.approx(max(weights), 1e-9, 1e-12)
    if "objective/masked_fraction" in metrics:
        dropped = np.mean([w == 0.0 for w in weights])
        assert metrics["objective/masked_fraction"] == pytest.approx(dropped)
    if "objective/proximal_gap" in metrics:
        gap = metrics["objective/proximal_gap"]
        assert gap >= 0.0
        assert (gap == 0.0) == (
            case.proximal_logp is None or np.all(case.proximal_logp == case.logp)
        )
    if "objective/second_moment" in metrics:
        m2 = np.mean((case.logp - case.sampler_logp) ** 2)
        assert metrics["objective/second_moment"] == pytest.approx(m2, rel=1e-9)


# --- properties of single objectives ---------------------------------------------------------


@PROPERTY
@given(case=cases())
def test_trl_objectives_equal_the_functions_of_core_losses_exactly(case: Case) -> None:
    s = case.settings
    config = LossConfig(
        epsilon=s.epsilon,
        epsilon_high=s.epsilon_high,
        vllm_importance_sampling_clip_min=s.vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=s.vllm_importance_sampling_clip_max,
    )
    logp, topk_logp = case.leaves(topk=True)
    inputs = case.inputs(logp, topk_logp)
    assert topk_logp is not None and inputs.topk is not None
    centered = score_centered_surrogate(
        logp, inputs.sampler_logp, inputs.advantages, topk_logp, inputs.topk, config
    )
    clipped = clipped_surrogate(logp, inputs.sampler_logp, inputs.advantages, config)
    for name, expected in (("score_centering", centered), ("clipped_surrogate", clipped)):
        objective = OBJECTIVES[name]
        assert torch.equal(objective.per_token_loss(inputs, s.of(objective)), expected), name


@PROPERTY
@given(case=cases(proximal=False))
def test_in_this_trainer_icepop_and_decoupled_ppo_are_token_masked_is(case: Case) -> None:
    """With one optimizer step per batch (no proximal policy), IcePop is token-level MIS with
    the range [alpha, beta] and decoupled PPO token-level MIS with [0, cap]."""
    s = case.settings
    logp, _ = case.leaves(topk=False)
    inputs = case.inputs(logp, None)
    mis = OBJECTIVES["mis_token"]
    for name, low, high in (
        ("icepop", s.icepop_alpha, s.icepop_beta),
        ("decoupled_ppo", 0.0, s.behav_imp_weight_cap),
    ):
        as_mis = s.replace(mis_token_clip_min=low, mis_token_clip_max=high)
        got = OBJECTIVES[name].per_token_loss(inputs, s.of(OBJECTIVES[name]))
        assert torch.equal(got, mis.per_token_loss(inputs, as_mis.of(mis))), name


@PROPERTY
@given(case=cases(proximal=False))
def test_in_this_trainer_cispo_without_a_lower_clip_has_the_gradient_of_tis(case: Case) -> None:
    s = case.settings
    logp, _ = case.leaves(topk=False)
    inputs = case.inputs(logp, None)
    as_cispo = s.replace(cispo_clip_min=0.0, cispo_clip_max=s.tis_token_cap)
    tis_token, cispo_objective = OBJECTIVES["tis_token"], OBJECTIVES["cispo"]
    tis_loss = tis_token.per_token_loss(inputs, s.of(tis_token))
    (tis,) = torch.autograd.grad(tis_loss.sum(), logp)
    cispo_loss = cispo_objective.per_token_loss(inputs, as_cispo.of(cispo_objective))
    (cispo,) = torch.autograd.grad(cispo_loss.sum(), logp)
    np.testing.assert_allclose(tis.numpy(), cispo.numpy(), rtol=1e-12, atol=1e-15)


@PROPERTY
@given(case=cases(), cuts=st.lists(st.integers(0, 20), max_size=3))
def test_splitting_a_call_does_not_change_the_per_token_losses(case: Case, cuts) -> None:
    """Objectives that are neither sequence-level nor batch-coupled give the same per-token
    losses on any split; sequence-level ones on splits at sample boundaries."""
    order = np.argsort(case.sample_index, kind="stable")
    case = replace(
        case,
        **{
            name: getattr(case, name)[order]
            for name in (
                "logp",
                "sampler_logp",
                "advantages",
                "sample_index",
                "topk_ids",
                "topk_sampler_logp",
                "topk_valid",
                "topk_logp",
            )
        },
        proximal_logp=None if case.proximal_logp is None else case.proximal_logp[order],
    )
    anywhere = [0, *sorted(min(c, case.n) for c in cuts), case.n]
    boundaries = [0, *(np.flatnonzero(np.diff(case.sample_index)) + 1).tolist(), case.n]
    for name, objective in OBJECTIVES.items():
        if objective.needs.batch_coupled:
            continue
        edges = boundaries if objective.needs.whole_samples else anywhere
        topk = objective.needs.sampler_topk
        logp, topk_logp = case.leaves(topk)
        whole = objective.per_token_loss(case.inputs(logp, topk_logp), case.settings.of(objective))
        pieces = []
        for a, b in itertools.pairwise(edges):
            piece = slice_case(case, a, b)
            piece_logp, piece_topk = piece.leaves(topk)
            pieces.append(
                objective.per_token_loss(
                    piece.inputs(piece_logp, piece_topk), piece.settings.of(objective)
                )
            )
        np.testing.assert_allclose(
            torch.cat(pieces).detach().numpy(),
            whole.detach().numpy(),
            rtol=1e-12,
            atol=1e-15,
            err_msg=name,
        )


def slice_case(case: Case, a: int, b: int) -> Case:
    names = (
        "logp",
        "sampler_logp",
        "advantages",
        "sample_index",
        "topk_ids",
        "topk_sampler_logp",
        "topk_valid",
        "topk_logp",
    )
    return replace(
        case,
        **{name: getattr(case, name)[a:b] for name in names},
        proximal_logp=None if case.proximal_logp is None else case.proximal_logp[a:b],
    )


@PROPERTY
@given(case=cases())
def test_m2po_bounds_the_second_moment_and_masks_no_more_than_needed(case: Case) -> None:
    from asyncgrpo.core.loss.objectives.m2po import m2po_keep, trust_region_tokens

    logp, _ = case.leaves(topk=False)
    inputs = case.inputs(logp, None)
    keep = m2po_keep(inputs, case.settings.of(OBJECTIVES["m2po"])).numpy()
    log_ratio = case.logp - case.sampler_logp
    trust = trust_region_tokens(torch.tensor(log_ratio), inputs.advantages).numpy()
    assert np.all(keep[~trust]), "only trust-region tokens are masked"
    second = log_ratio**2
    tau = case.settings.m2po_threshold
    kept = second[trust & keep]
    if kept.size:
        assert kept.mean() <= tau * (1 + 1e-12)
    removed = second[trust & ~keep]
    if removed.size:
        assert removed.min() >= (kept.max() if kept.size else 0.0)
        with_one_back = np.append(kept, removed.min())
        assert with_one_back.mean() > tau * (1 - 1e-12)


@pytest.mark.parametrize(
    ("logp0", "sampler0", "every_objective_drops_it"),
    [(0.0, -900.0, False), (-math.inf, -1.0, True)],
    ids=["ratio_overflows", "logp_minus_inf"],
)
def test_dropped_tokens_contribute_zero_and_no_nan(logp0, sampler0, every_objective_drops_it):
    """Token 0's ratio is exp(900), or 0 with a log-prob of -inf (a target outside its candidate
    set); the others are on-policy. Every loss and gradient stays finite, no metric is NaN, and
    an objective that drops token 0 (weight 0) gives it exactly 0 loss and 0 gradient."""
    logp = torch.tensor([logp0, -1.0, -1.0], dtype=F64, requires_grad=True)
    inputs = TokenInputs(
        logp=logp,
        sampler_logp=torch.tensor([sampler0, -1.0, -1.0], dtype=F64),
        advantages=torch.tensor([1.0, 1.0, -1.0], dtype=F64),
        sample_index=torch.tensor([0, 1, 2]),
        entropy=torch.zeros(3, dtype=F64),
    )
    dropping = []
    for name, objective in OBJECTIVES.items():
        if objective.needs.sampler_topk:
            continue
        defaults = objective.settings_type()
        loss = objective.per_token_loss(inputs, defaults)
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), name
        metrics = objective.metrics(inputs, defaults)
        # no NaN; M2PO's second moment of a zero-probability target is honestly infinite
        assert not any(math.isnan(v) for v in metrics.values()), (name, metrics)
        if every_objective_drops_it or metrics.get("objective/masked_fraction", 0.0) > 0.0:
            dropping.append(name)
            assert loss[0].item() == 0.0 and grad[0].item() == 0.0, name
    assert "clipped_surrogate" in dropping


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_call_gives_an_empty_loss_with_grad_and_no_metrics(name: str) -> None:
    logp = torch.zeros(0, dtype=F64, requires_grad=True)
    topk = SamplerTopK(
        torch.zeros(0, 3).long(), torch.zeros(0, 3, dtype=F64), torch.zeros(0, 3).bool()
    )
    inputs = TokenInputs(
        logp=logp,
        sampler_logp=torch.zeros(0, dtype=F64),
        advantages=torch.zeros(0, dtype=F64),
        sample_index=torch.zeros(0, dtype=torch.long),
        entropy=torch.zeros(0, dtype=F64),
        topk_logp=torch.zeros(0, 3, dtype=F64, requires_grad=True),
        topk=topk,
    )
    defaults = OBJECTIVES[name].settings_type()
    loss = OBJECTIVES[name].per_token_loss(inputs, defaults)
    assert loss.shape == (0,)
    loss.sum().backward()
    assert OBJECTIVES[name].metrics(inputs, defaults) == {}


def test_score_centering_without_the_sampler_topk_says_what_is_missing() -> None:
    inputs = TokenInputs(
        logp=torch.zeros(1),
        sampler_logp=torch.zeros(1),
        advantages=torch.ones(1),
        sample_index=torch.zeros(1).long(),
        entropy=torch.zeros(1),
    )
    with pytest.raises(ValueError, match="top-K"):
        OBJECTIVES["score_centering"].per_token_loss(
            inputs, OBJECTIVES["score_centering"].settings_type()
        )


# --- registry ----------------------------------------------------------------------------------


def test_every_objective_is_registered_under_its_name_and_follows_the_protocol() -> None:
    for name, objective in OBJECTIVES.items():
        assert objective.name == name
        assert isinstance(objective, Objective)
        assert isinstance(objective.needs, Needs)
    assert set(REFERENCES) == set(OBJECTIVES), "every objective needs its brute-force test"


def test_every_objective_module_is_in_the_registry() -> None:
    helpers = {"base", "weights"}
    modules = {info.name for info in pkgutil.iter_modules(objectives_package.__path__)}
    registered = {
        module
        for module in modules - helpers
        if any(OBJECTIVES.get(o.name) is o for o in module_objectives(module))
    }
    assert modules - helpers == registered


def module_objectives(module: str) -> tuple:
    return importlib.import_module(f"{objectives_package.__name__}.{module}").OBJECTIVES


@pytest.mark.parametrize("name", NAMES)
def test_what_the_objective_needs(name: str) -> None:
    needs = OBJECTIVES[name].needs
    declared = {field.name for field in attrs.fields(Needs) if getattr(needs, field.name)}
    assert declared == REFERENCES[name].needs


def test_an_unknown_loss_type_lists_the_valid_names_and_the_closest() -> None:
    with pytest.raises(ValueError, match="unknown loss_type 'score_centring'") as error:
        objective_for("score_centring")
    message = str(error.value)
    assert "did you mean 'score_centering'?" in message
    assert all(name in message for name in OBJECTIVES)


def test_score_centering_maps_onto_loss_type() -> None:
    assert loss_type_from(None, score_centering=True) == "score_centering"
    assert loss_type_from(None, score_centering=False) == "clipped_surrogate"
    assert loss_type_from("clipped_surrogate", score_centering=False) == "clipped_surrogate"
    for name in OBJECTIVES:
        assert loss_type_from(name, score_centering=True) == name
        if name != "clipped_surrogate":
            with pytest.raises(ValueError, match="score_centering=False"):
                loss_type_from(name, score_centering=False)
    with pytest.raises(ValueError, match="unknown loss_type"):
        loss_type_from("ppo", score_centering=True)


# --- input and settings checks ----------------------------------------------------------------


def token_inputs(**overrides):
    args = {
        "logp": torch.zeros(2),
        "sampler_logp": torch.zeros(2),
        "advantages": torch.ones(2),
        "sample_index": torch.tensor([0, 1]),
        "entropy": torch.zeros(2),
    }
    args.update(overrides)
    return TokenInputs(**args)


TOPK = SamplerTopK(torch.zeros(2, 3).long(), torch.zeros(2, 3), torch.ones(2, 3).bool())


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"logp": torch.zeros(2, 1)}, ValueError, "logp has shape"),
        ({"logp": torch.zeros(2).long()}, TypeError, "logp has dtype"),
        ({"sampler_logp": torch.zeros(3)}, ValueError, "sampler_logp has shape"),
        ({"sampler_logp": torch.zeros(2, dtype=F64)}, TypeError, r"sampler_logp .*to\(logp"),
        ({"advantages": torch.ones(2).long()}, TypeError, r"advantages .*\.float\(\)"),
        ({"sample_index": torch.zeros(2)}, TypeError, r"sample_index .*\.long\(\)"),
        ({"sample_index": torch.zeros(3).long()}, ValueError, "sample_index has shape"),
        ({"entropy": torch.zeros(2, requires_grad=True)}, ValueError, "entropy requires grad"),
        ({"proximal_logp": torch.zeros(1)}, ValueError, "proximal_logp has shape"),
        (
            {"proximal_logp": torch.zeros(2, requires_grad=True)},
            ValueError,
            "proximal_logp requires",
        ),
        ({"topk": TOPK}, ValueError, "topk_logp and topk go together"),
        ({"topk_logp": torch.zeros(2, 3)}, ValueError, "topk_logp and topk go together"),
        ({"topk": TOPK, "topk_logp": torch.zeros(2, 2)}, ValueError, "topk_logp has shape"),
        (
            {
                "topk": SamplerTopK(
                    torch.zeros(3, 1).long(), torch.zeros(3, 1), torch.ones(3, 1).bool()
                ),
                "topk_logp": torch.zeros(3, 1),
            },
            ValueError,
            "topk has 3 rows",
        ),
    ],
)
def test_bad_token_inputs_name_the_field(overrides, error, match) -> None:
    with pytest.raises(error, match=match):
        token_inputs(**overrides)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"epsilon": 1.5}, "epsilon must lie"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"vllm_importance_sampling_clip_max": 0.9}, "vllm_importance_sampling_clip_max"),
        ({"mis_sequence_clip_min": 1.2}, "mis_sequence_clip_min"),
        ({"mis_geometric_clip_max": math.nan}, "mis_geometric_clip_max"),
        ({"icepop_alpha": -0.1}, "icepop_alpha"),
        ({"cispo_clip_min": 2.0}, "cispo_clip_min"),
        ({"tis_token_cap": 0.5}, "tis_token_cap"),
        ({"tis_sequence_cap": math.nan}, "tis_sequence_cap"),
        ({"behav_imp_weight_cap": 0.9}, "behav_imp_weight_cap"),
        ({"m2po_threshold": -0.01}, "m2po_threshold"),
        ({"m2po_threshold": math.inf}, "m2po_threshold"),
    ],
)
def test_bad_settings_name_the_field(change, match) -> None:
    (name,) = change
    declaring = [t for t in SETTINGS_TYPES if name in attrs.fields_dict(t)]
    assert declaring, f"no settings record declares {name}"
    for settings_type in declaring:  # built, and evolved from valid settings
        with pytest.raises(ValueError, match=match):
            settings_type(**change)
        with pytest.raises(ValueError, match=match):
            attrs.evolve(settings_type(), **change)


def test_each_objective_reads_its_own_record_with_the_shared_settings_declared_once() -> None:
    by_name = {setting.name: setting for setting in SETTINGS}
    for objective in OBJECTIVES.values():
        record = objective.settings_type
        assert issubclass(record, ObjectiveSettings), objective.name
        for field in attrs.fields(record):  # inherited fields are the same declaration
            assert field.default == by_name[field.name].default, (objective.name, field.name)
    assert attrs.fields_dict(OBJECTIVES["tis_token"].settings_type).keys() >= {
        "epsilon",
        "epsilon_high",
        "tis_token_cap",
    }
    assert "epsilon" not in attrs.fields_dict(OBJECTIVES["cispo"].settings_type)
    assert len(SETTINGS) == len(by_name)


def test_settings_for_takes_only_the_records_names_and_allows_an_infinite_upper_bound() -> None:
    values = {setting.name: setting.default for setting in SETTINGS}
    tis = settings_for(OBJECTIVES["tis_sequence"].settings_type, {**values, "tis_sequence_cap": 9})
    assert tis.tis_sequence_cap == 9 and not hasattr(tis, "cispo_clip_max")
    relaxed = attrs.evolve(
        settings_for(OBJECTIVES["mis_sequence"].settings_type, values),
        mis_sequence_clip_max=math.inf,
    )
    assert relaxed.mis_sequence_clip_max == math.inf


# --- worked examples ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module",
    [info.name for info in pkgutil.iter_modules(objectives_package.__path__)],
)
def test_docstring_examples_of_every_objective_module(module: str) -> None:
    loaded = importlib.import_module(f"asyncgrpo.core.loss.objectives.{module}")
    result = doctest.testmod(loaded, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module} has no worked example"
    assert result.failed == 0
