"""What every policy objective takes in, declares and returns: the seam between the learner and
its objective.

An objective (:class:`Objective`) turns the immutable per-token inputs of one call
(:class:`TokenInputs`: N trained tokens flattened over one packed row) and its settings record
(a subclass of :class:`ObjectiveSettings`) into a per-token loss, float [N], and a dict of
metrics. It declares what the shell must provide for it in :class:`Needs`, so that the learner
and the rollout side ask the objective instead of branching on booleans.

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

**Settings.** Each objective module declares the hyperparameters it reads as one frozen record,
a subclass of :class:`ObjectiveSettings` whose fields :func:`setting` makes (default, help, the
default's source, its check); the shared ones (the trust region and TRL's keep range) are
records in :mod:`asyncgrpo.core.loss.objectives.weights` that the others extend. An objective
names its record in ``settings_type`` and reads only it. ``AsyncGRPOConfig`` has a field of each
declared setting under TRL's flat name, with its default and help, and builds the chosen
objective's record from those fields. Names are TRL-style, prefixed by the objective (as TRL's
``sapo_temperature_pos``). ``tis_*``, ``mis_*`` and ``icepop_*`` carry one pair (or cap) per
level because a sequence's product of ratios and its geometric mean live on very different
scales (a product over 500 tokens, a mean that stays within 1%).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

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
        floats = [
            ("sampler_logp", self.sampler_logp),
            ("advantages", self.advantages),
            ("entropy", self.entropy),
        ]
        if self.proximal_logp is not None:
            floats.append(("proximal_logp", self.proximal_logp))
        for name, tensor in floats:
            check_tensor(name, tensor, (n,), "float", why)
            _check_same_dtype(name, tensor, self.logp)
        check_tensor("sample_index", self.sample_index, (n,), "long", why)
        for name, detached in (("entropy", self.entropy), ("proximal_logp", self.proximal_logp)):
            if detached is not None and detached.requires_grad:
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


@attrs.frozen
class ObjectiveSettings:
    """The base of every objective's settings record. Each objective module declares one frozen
    record of the hyperparameters it reads (``TISSettings``, ``CISPOSettings``, ...), each field
    made by :func:`setting`: its one default, help and check. The shared ones (the trust region
    and TRL's keep range) are records in :mod:`asyncgrpo.core.loss.objectives.weights` that the
    others extend. A record is checked when built (a bad value raises naming its field);
    :func:`attrs.evolve` gives a changed copy, checked again."""


def setting(
    default: float | None,
    help: str,
    source: str,
    check: Callable[[Any, attrs.Attribute, Any], None],
    *,
    optional: bool = False,
) -> Any:
    """A field of an objective's settings record: ``AsyncGRPOConfig`` has a field of the same
    name (TRL-style, prefixed by the objective, as TRL's ``vespo_k_pos``) with this default and
    help (docs/configuration.md and ``asyncgrpo train --help`` show them).

    Args:
        default: its one default.
        help: the config field's help text.
        source: where the default comes from (a paper, a framework's setting).
        check: an attrs validator: raises ValueError naming the field when its value is bad.
        optional: None is a valid value too (the check is skipped for it).
    """
    validator = attrs.validators.optional(check) if optional else check
    return attrs.field(
        default=default,
        validator=validator,
        metadata={"help": help, "source": source, "optional": optional},
    )


@attrs.frozen
class Setting:
    """One objective hyperparameter as its record's field declares it (:func:`setting`), for
    the config fields and docs generated from it.

    Attributes:
        name: the config field and record field.
        default: its one default.
        help: the config field's help text.
        source: where the default comes from.
        optional: None is a valid value.
    """

    name: str
    default: float | None
    help: str
    source: str
    optional: bool

    @classmethod
    def of(cls, field: attrs.Attribute) -> Setting:
        """The declaration of a record's ``field`` (made by :func:`setting`)."""
        return cls(
            name=field.name,
            default=field.default,
            help=field.metadata["help"],
            source=field.metadata["source"],
            optional=field.metadata["optional"],
        )


def settings_of(settings_type: type[ObjectiveSettings]) -> tuple[Setting, ...]:
    """The declarations of a settings record's fields, inherited ones first."""
    return tuple(Setting.of(field) for field in attrs.fields(settings_type))


SettingsT = TypeVar("SettingsT", bound=ObjectiveSettings)


def settings_for(settings_type: type[SettingsT], values: Mapping[str, Any]) -> SettingsT:
    """A ``settings_type`` record from ``values`` by field name: the names it declares are
    taken (absent ones keep the record's default), the others are not its own and are left.

    Example:
        >>> @attrs.frozen(kw_only=True)
        ... class Capped(ObjectiveSettings):
        ...     cap: float = setting(2.0, "a cap", "an example", cap)
        >>> settings_for(Capped, {"cap": 3.0, "other": 1.0})
        Capped(cap=3.0)
        >>> settings_for(Capped, {"cap": 0.5})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: cap must be >= 1 (math.inf for no cap), got 0.5; ...
    """
    own = {field.name for field in attrs.fields(settings_type)}
    return settings_type(**{name: value for name, value in values.items() if name in own})


def finite(_: object, field: attrs.Attribute, value: float | None) -> None:
    """A finite value >= 0."""
    if value is None or not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{field.name} must be finite and >= 0, got {value}")


def cap(_: object, field: attrs.Attribute, value: float | None) -> None:
    """A cap on a ratio: >= 1, ``math.inf`` for none."""
    if value is None or math.isnan(value) or value < 1.0:
        raise ValueError(
            f"{field.name} must be >= 1 (math.inf for no cap), got {value}; a cap below 1 "
            "down-weights on-policy tokens"
        )


def unit_interval(_: object, field: attrs.Attribute, value: float | None) -> None:
    """A value in [0, 1]."""
    if value is None or not 0.0 <= value <= 1.0:
        raise ValueError(f"{field.name} must lie in [0, 1], got {value}")


@attrs.frozen
class RangeContainingOne:
    """The check of a keep range ``(low, high)``, declared on its upper end (attrs checks once
    every field is set): it must contain 1 (``0 <= low <= 1 <= high``, high may be
    ``math.inf``), or it would drop every on-policy token.

    Attributes:
        low_name: the field of the lower end.
        high_name: the field of the upper end.
    """

    low_name: str
    high_name: str

    def __call__(self, instance: object, _: attrs.Attribute, __: object) -> None:
        low, high = getattr(instance, self.low_name), getattr(instance, self.high_name)
        if (
            low is None
            or high is None
            or not (math.isfinite(low) and 0.0 <= low <= 1.0 <= high)
            or math.isnan(high)
        ):
            raise ValueError(
                f"need 0 <= {self.low_name} <= 1 <= {self.high_name} ({self.high_name} may be "
                f"math.inf), got {low} and {high}; a range without 1 drops every on-policy token"
            )


# --- the objective ----------------------------------------------------------------------------


@runtime_checkable
class Objective(Protocol[SettingsT]):
    """A policy objective: a registry name, what it needs, its settings record, its per-token
    loss and its metrics.

    Attributes:
        name: the registry key, the value of the config's ``loss_type``.
        needs: what the shell must provide (:class:`Needs`).
    """

    name: str
    needs: Needs

    @property
    def settings_type(self) -> type[SettingsT]:
        """The record of the hyperparameters it reads (its defaults are the config's)."""
        ...

    def per_token_loss(self, inputs: TokenInputs, settings: SettingsT) -> Tensor:
        """float [N] per-token losses, with grad through ``inputs.logp`` (and
        ``inputs.topk_logp`` when used); their sum is what ``normalize_loss`` divides by the
        global trained-token count. A dropped token's loss is exactly 0 with zero gradient."""
        ...

    def metrics(self, inputs: TokenInputs, settings: SettingsT) -> dict[str, Tensor]:
        """The objective's own metrics over the call's tokens, computed without grad, each a
        finite 0-d tensor left on the device (:func:`metric_values`; an empty dict when
        N = 0). Record each with weight N; the ``_max`` ones
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


def metric_values(names: tuple[str, ...], values: list[Tensor]) -> dict[str, Tensor]:
    """``names`` to each 0-d tensor of ``values``, detached and in float64 (so that a float32
    fraction does not round the others), where they are: nothing is copied to the host, so
    the learner takes a step's metrics to the host once (``float(value)`` reads one).

    Example:
        >>> {name: float(v) for name, v in metric_values(
        ...     ("a", "b"), [torch.tensor(1.0), torch.tensor(0.5)]).items()}
        {'a': 1.0, 'b': 0.5}
    """
    return {name: v.detach().to(torch.float64) for name, v in zip(names, values, strict=True)}
