"""What every policy objective takes in, declares and returns: the seam between the learner and
its objective.

An objective (:class:`Objective`) turns the immutable per-token inputs of one call
(:class:`TokenInputs`: N trained tokens flattened over one packed row) and the hyperparameters
(:class:`ObjectiveSettings`) into a per-token loss, float [N], and a dict of metrics. It declares
what the shell must provide for it in :class:`Needs`, so that the learner and the rollout side
ask the objective instead of branching on booleans.

Conventions shared by every objective:

* ``per_token_loss(inputs, settings).sum()`` is what
  :func:`~asyncgrpo.core.loss.losses.normalize_loss` divides by the global number of trained tokens
  (dropped tokens count in that number, as in TRL's AsyncGRPOTrainer documentation). An
  objective whose :attr:`Needs.whole_samples` and :attr:`Needs.batch_coupled` are False gives
  per-token losses that do not depend on how tokens are grouped into calls, so packing and
  chunking do not change the loss.
* Three policies appear: the sampler ``mu`` (vLLM's processed log-probs, the behaviour policy
  that generated the tokens), the current policy ``pi`` (``logp``, with grad) and, for the
  decoupled objectives, a proximal policy ``pi_prox`` (``proximal_logp``). This trainer takes
  one optimizer step per batch, so at gradient time the proximal policy *is* the current one:
  when ``proximal_logp`` is None the objectives use ``logp.detach()``, which costs no forward.
* Weights computed from log-probs are detached; gradient flows through ``logp`` and
  ``topk_logp`` only, never through the sampler's or the proximal log-probs.

**Settings and their proposed config fields.** :class:`ObjectiveSettings` has no defaults: each
setting gets its one default in ``AsyncGRPOConfig``. Proposed names (TRL-style, prefixed by the
objective as TRL's ``sapo_temperature_pos`` or ``vespo_k_pos``) and recommended defaults:

======================================  ===========  ==========================================
config field                            default      source of the default
======================================  ===========  ==========================================
``epsilon``                             0.2          TRL (GRPOConfig, AsyncGRPOConfig)
``epsilon_high``                        None (=eps)  TRL; DAPO recommends 0.28
``vllm_importance_sampling_clip_min``   0.5          TRL's AsyncGRPOTrainer documentation
``vllm_importance_sampling_clip_max``   5.0          TRL's AsyncGRPOTrainer documentation
``tis_token_cap``                       2.0          Yao et al. 2025 (TIS blog, C = 2); verl
                                                     ``rollout_is_threshold``; SkyRL
                                                     ``token_tis_ratio_clip_high``
``tis_sequence_cap``                    5.0          SkyRL ``sequence_tis_ratio_clip_high``
                                                     (verl: typical 2-10)
``tis_geometric_cap``                   2.0          slime ``mis_upper_bound`` (slime applies
                                                     one bound at every level)
``mis_token_clip_min``                  0.5          slime ``mis_lower_bound``; verl token RS
                                                     (lower = 1 / upper)
``mis_token_clip_max``                  2.0          slime ``mis_upper_bound``; verl token RS
``mis_sequence_clip_min``               0.5          SkyRL ``product_mask_low``
``mis_sequence_clip_max``               2.0          SkyRL ``product_mask_high``
``mis_geometric_clip_min``              0.99         SkyRL ``geo_mask_low``
``mis_geometric_clip_max``              1.01         SkyRL ``geo_mask_high`` (verl: typical
                                                     1.0002-1.001)
``icepop_alpha``                        0.5          IcePop as shipped by prime-rl (INTELLECT-3)
``icepop_beta``                         5.0          IcePop as shipped by prime-rl (INTELLECT-3)
``behav_imp_weight_cap``                5.0          AReaL's name; its example configs use 5.0
``m2po_threshold``                      0.04         M2PO paper, section 5.2 (AReaL
                                                     ``m2_threshold``)
``cispo_clip_min``                      0.0          MiniMax-M1 (no lower clip); ScaleRL; SkyRL
                                                     ``1 - cispo_eps_clip_low``
``cispo_clip_max``                      5.0          ScaleRL via TRL's ``loss_type="cispo"``
                                                     docs; SkyRL ``1 + cispo_eps_clip_high``
======================================  ===========  ==========================================

The first four exist in ``AsyncGRPOConfig`` already. ``tis_*``, ``mis_*``, ``icepop_*`` carry one
pair (or cap) per level because a sequence's product of ratios and its geometric mean live on
very different scales (a product over 500 tokens, a mean that stays within 1%).
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor

from asyncgrpo.core.loss.inputs import SamplerTopK, check_kind, check_tensor

# --- inputs ---------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class TokenInputs:
    """The per-token inputs of one objective call: N trained tokens of one packed row.

    Every trained token of a sample lies in the same row, so a call that is given one row holds
    whole samples. Tokens of one sample need not be contiguous, and sample ids are any longs.

    Attributes:
        logp: float [N] policy log-probs (nats) of the sampled tokens, with grad.
        sampler_logp: float [N] vLLM's processed log-probs of the same tokens (nats).
        advantages: float [N] each token's advantage (its sample's, for GRPO).
        sample_index: long [N] the sample each token belongs to.
        entropy: float [N] the policy's entropy at each position (nats), detached.
        topk_logp: float [N, K] policy log-probs of ``topk.ids``, with grad, -inf where
            ``topk.valid`` is False; given together with ``topk``, or None.
        topk: the sampler's top-K ids and log-probs at each position, or None.
        proximal_logp: float [N] the proximal policy's log-probs (nats), detached; None means
            the proximal policy is the current one (``logp.detach()``).

    The floating tensors must share ``logp``'s dtype. Bad inputs raise naming the field.

    Example:
        >>> inputs = TokenInputs(
        ...     logp=torch.tensor([-1.0, -2.0]), sampler_logp=torch.tensor([-1.1, -2.0]),
        ...     advantages=torch.tensor([0.5, 0.5]), sample_index=torch.tensor([7, 7]),
        ...     entropy=torch.zeros(2))
        >>> inputs.n, inputs.proximal().tolist()
        (2, [-1.0, -2.0])
        >>> TokenInputs(logp=torch.zeros(2), sampler_logp=torch.zeros(3),
        ...     advantages=torch.zeros(2), sample_index=torch.zeros(2).long(),
        ...     entropy=torch.zeros(2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: sampler_logp has shape (3,); it must be (2,) to match logp's N trained tokens
    """

    logp: Tensor
    sampler_logp: Tensor
    advantages: Tensor
    sample_index: Tensor
    entropy: Tensor
    topk_logp: Tensor | None = None
    topk: SamplerTopK | None = None
    proximal_logp: Tensor | None = None

    def __attrs_post_init__(self) -> None:
        check_kind("logp", self.logp, "float")
        if self.logp.dim() != 1:
            raise ValueError(
                f"logp has shape {tuple(self.logp.shape)}; it must be [N]: one log-prob per "
                "trained token, flattened over the row"
            )
        n = self.logp.shape[0]
        why = "match logp's N trained tokens"
        floats = [("sampler_logp", self.sampler_logp), ("advantages", self.advantages),
                  ("entropy", self.entropy)]  # fmt: skip
        if self.proximal_logp is not None:
            floats.append(("proximal_logp", self.proximal_logp))
        for name, tensor in floats:
            check_tensor(name, tensor, (n,), "float", why)
            _check_same_dtype(name, tensor, self.logp)
        check_tensor("sample_index", self.sample_index, (n,), "long", why)
        for name, tensor in (("entropy", self.entropy), ("proximal_logp", self.proximal_logp)):
            if tensor is not None and tensor.requires_grad:
                raise ValueError(
                    f"{name} requires grad; it must be detached (pass {name}.detach()): no "
                    "gradient may flow through it"
                )
        if (self.topk_logp is None) != (self.topk is None):
            raise ValueError(
                "topk_logp and topk go together: pass both (the policy's and the sampler's "
                "log-probs of the sampler's top-K ids) or neither"
            )
        if self.topk is not None and self.topk_logp is not None:
            shape = tuple(self.topk.ids.shape)
            if shape[0] != n:
                raise ValueError(
                    f"topk has {shape[0]} rows but logp has {n} trained tokens; gather the "
                    "sampler's top-K at the same trained positions"
                )
            check_tensor("topk_logp", self.topk_logp, shape, "float", "match topk.ids")
            _check_same_dtype("topk_logp", self.topk_logp, self.logp)

    @property
    def n(self) -> int:
        """N, the number of trained tokens."""
        return self.logp.shape[0]

    def proximal(self) -> Tensor:
        """float [N] the proximal policy's log-probs: ``proximal_logp``, or ``logp.detach()``
        when the proximal policy is the current one."""
        return self.logp.detach() if self.proximal_logp is None else self.proximal_logp


def _check_same_dtype(name: str, tensor: Tensor, logp: Tensor) -> None:
    if tensor.dtype != logp.dtype:
        raise TypeError(
            f"{name} has dtype {tensor.dtype} but logp has {logp.dtype}; convert it with "
            f".to(logp.dtype)"
        )


# --- what an objective needs ----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Needs:
    """What the shell must provide for an objective, declared by the objective.

    Attributes:
        sampler_topk: ``topk`` and ``topk_logp`` must be given: the rollout side requests the
            sampler's top-K log-probs (``num_sampler_logprobs``) and the learner gathers the
            policy's log-probs of those ids.
        proximal_logp: ``proximal_logp`` must be given, which costs a no-grad forward of the
            proximal policy. No objective here sets it: with one optimizer step per batch the
            proximal policy is the current one (see the module docstring).
        whole_samples: every call must hold all trained tokens of each sample it holds
            (sequence-level weights). True of one packed row per call; False means per-token
            losses are the same however the tokens are split.
        batch_coupled: a token's loss depends on the other tokens of the call (a statistic over
            the call, as M2PO's second moment), so how the shell groups tokens into calls
            changes the loss.

    Example:
        >>> Needs(sampler_topk=True, proximal_logp=False, whole_samples=False,
        ...       batch_coupled=False).sampler_topk
        True
    """

    sampler_topk: bool
    proximal_logp: bool
    whole_samples: bool
    batch_coupled: bool


# --- settings -------------------------------------------------------------------------------


def _finite(_: object, attribute: attrs.Attribute, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be finite, got {value}")


def _cap(_: object, attribute: attrs.Attribute, value: float) -> None:
    if math.isnan(value) or value < 1.0:
        raise ValueError(
            f"{attribute.name} must be >= 1 (math.inf for no cap), got {value}; a cap below 1 "
            "down-weights on-policy tokens"
        )


@attrs.frozen(kw_only=True)
class ObjectiveSettings:
    """Every hyperparameter any objective uses, under the proposed config names (the module
    docstring lists each one's recommended default and its source). Validated when built; no
    defaults here.

    A keep range ``(clip_min, clip_max)`` must contain 1 (``0 <= min <= 1 <= max``, max may be
    ``math.inf``), or it would drop every on-policy token. A cap must be >= 1.

    Attributes:
        epsilon: lower trust-region width: the PPO ratio is clipped below at ``1 - epsilon``.
        epsilon_high: upper width, ``1 + epsilon_high``; None means ``epsilon``.
        vllm_importance_sampling_clip_min: lower end of the keep range of TRL's two objectives
            (score centering, clipped surrogate).
        vllm_importance_sampling_clip_max: its upper end.
        tis_token_cap: TIS cap C on the token ratio.
        tis_sequence_cap: TIS cap on a sample's product of ratios.
        tis_geometric_cap: TIS cap on a sample's geometric-mean ratio.
        mis_token_clip_min: masked-IS keep range of the token ratio, lower end.
        mis_token_clip_max: its upper end.
        mis_sequence_clip_min: masked-IS keep range of a sample's product of ratios, lower end.
        mis_sequence_clip_max: its upper end.
        mis_geometric_clip_min: masked-IS keep range of a sample's geometric-mean ratio.
        mis_geometric_clip_max: its upper end.
        icepop_alpha: IcePop's lower bound on the train/infer ratio.
        icepop_beta: IcePop's upper bound.
        behav_imp_weight_cap: decoupled PPO drops tokens whose behaviour weight
            ``pi_prox / mu`` exceeds this.
        m2po_threshold: M2PO's bound on the mean squared log-ratio of the kept tokens (>= 0).
        cispo_clip_min: CISPO clips its IS weight below at this.
        cispo_clip_max: and above at this.
    """

    epsilon: float
    epsilon_high: float | None
    vllm_importance_sampling_clip_min: float
    vllm_importance_sampling_clip_max: float
    tis_token_cap: float = attrs.field(validator=_cap)
    tis_sequence_cap: float = attrs.field(validator=_cap)
    tis_geometric_cap: float = attrs.field(validator=_cap)
    mis_token_clip_min: float
    mis_token_clip_max: float
    mis_sequence_clip_min: float
    mis_sequence_clip_max: float
    mis_geometric_clip_min: float
    mis_geometric_clip_max: float
    icepop_alpha: float
    icepop_beta: float
    behav_imp_weight_cap: float = attrs.field(validator=_cap)
    m2po_threshold: float = attrs.field(validator=_finite)
    cispo_clip_min: float
    cispo_clip_max: float

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"epsilon must lie in [0, 1], got {self.epsilon}; 0.2 is usual")
        if self.epsilon_high is not None and not (
            math.isfinite(self.epsilon_high) and self.epsilon_high >= 0.0
        ):
            raise ValueError(
                f"epsilon_high must be finite and >= 0, got {self.epsilon_high}; or None to use "
                "epsilon"
            )
        for prefix in ("vllm_importance_sampling", "mis_token", "mis_sequence", "mis_geometric",
                       "cispo"):  # fmt: skip
            _check_range(self, f"{prefix}_clip_min", f"{prefix}_clip_max")
        _check_range(self, "icepop_alpha", "icepop_beta")
        if self.m2po_threshold < 0.0:
            raise ValueError(
                f"m2po_threshold must be >= 0, got {self.m2po_threshold}; the paper uses 0.04"
            )

    @property
    def trust_region(self) -> tuple[float, float]:
        """``(1 - epsilon, 1 + epsilon_high)``, with ``epsilon_high`` defaulting to epsilon."""
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        return 1.0 - self.epsilon, 1.0 + high


def _check_range(settings: ObjectiveSettings, low_name: str, high_name: str) -> None:
    low, high = getattr(settings, low_name), getattr(settings, high_name)
    if not (math.isfinite(low) and 0.0 <= low <= 1.0 <= high) or math.isnan(high):
        raise ValueError(
            f"need 0 <= {low_name} <= 1 <= {high_name} ({high_name} may be math.inf), got "
            f"{low} and {high}; a range without 1 drops every on-policy token"
        )


# --- the objective ----------------------------------------------------------------------------


@runtime_checkable
class Objective(Protocol):
    """A policy objective: a registry name, what it needs, its per-token loss and its metrics.

    Attributes:
        name: the registry key, the value of the config's ``loss_type``.
        needs: what the shell must provide (:class:`Needs`).
    """

    name: str
    needs: Needs

    def per_token_loss(self, inputs: TokenInputs, settings: ObjectiveSettings) -> Tensor:
        """float [N] per-token losses, with grad through ``inputs.logp`` (and
        ``inputs.topk_logp`` when used); their sum is what ``normalize_loss`` divides by the
        global trained-token count. A dropped token's loss is exactly 0 with zero gradient."""
        ...

    def metrics(self, inputs: TokenInputs, settings: ObjectiveSettings) -> dict[str, float]:
        """The objective's own metrics over the call's tokens, computed without grad, each a
        finite float (an empty dict when N = 0). Record each with weight N; the ``_max`` ones
        keep the extreme. Names and meanings are in
        :mod:`asyncgrpo.core.loss.objectives.weights` and ``docs/objectives.md``."""
        ...


def empty_loss(inputs: TokenInputs) -> Tensor:
    """float [0] with grad through ``logp``, for a call without tokens.

    Example:
        >>> empty_loss(TokenInputs(logp=torch.zeros(0, requires_grad=True),
        ...     sampler_logp=torch.zeros(0), advantages=torch.zeros(0),
        ...     sample_index=torch.zeros(0).long(), entropy=torch.zeros(0))).shape
        torch.Size([0])
    """
    return inputs.logp * 0.0


def metric_values(names: tuple[str, ...], values: list[Tensor]) -> dict[str, float]:
    """``names`` to the float of each 0-d tensor in ``values`` (stacked in float64, so a float32
    fraction does not round the others), in one device-to-host copy.

    Example:
        >>> metric_values(("a", "b"), [torch.tensor(1.0), torch.tensor(0.5)])
        {'a': 1.0, 'b': 0.5}
    """
    stacked = torch.stack([v.detach().to(torch.float64) for v in values])
    return dict(zip(names, stacked.tolist(), strict=True))


def example_settings() -> ObjectiveSettings:
    """Settings with the recommended values of the module docstring's table, for worked
    examples and tests. The shell builds its settings from ``AsyncGRPOConfig``, which holds the
    one default of each setting.

    Example:
        >>> example_settings().trust_region
        (0.8, 1.2)
    """
    return ObjectiveSettings(
        epsilon=0.2, epsilon_high=None,
        vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=5.0,
        tis_token_cap=2.0, tis_sequence_cap=5.0, tis_geometric_cap=2.0,
        mis_token_clip_min=0.5, mis_token_clip_max=2.0,
        mis_sequence_clip_min=0.5, mis_sequence_clip_max=2.0,
        mis_geometric_clip_min=0.99, mis_geometric_clip_max=1.01,
        icepop_alpha=0.5, icepop_beta=5.0, behav_imp_weight_cap=5.0, m2po_threshold=0.04,
        cispo_clip_min=0.0, cispo_clip_max=5.0,
    )  # fmt: skip
