"""Policy objectives, one module each, and the registry keyed by the config's ``loss_type``.

Every objective follows the :class:`~asyncgrpo.core.loss.objectives.base.Objective` protocol: from
the immutable per-token inputs of one call
(:class:`~asyncgrpo.core.loss.objectives.base.TokenInputs`) and its own settings record (its
``settings_type``, a subclass of :class:`~asyncgrpo.core.loss.objectives.base.ObjectiveSettings`)
it gives a per-token loss and its metrics, and it declares what the shell must provide
(:class:`~asyncgrpo.core.loss.objectives.base.Needs`). ``docs/objectives.md`` explains each one.

======================  ====================================================================
``loss_type``           objective (module)
======================  ====================================================================
``score_centering``     TRL's score centering, the default (``score_centering``)
``clipped_surrogate``   TRL's clipped surrogate with masked IS (``clipped_surrogate``)
``tis_token``           truncated IS, token / sequence / geometric-mean level (``tis``)
``tis_sequence``
``tis_geometric``
``mis_token``           masked IS, token / sequence / geometric-mean level (``mis``)
``mis_sequence``
``mis_geometric``
``icepop``              IcePop's two-sided train/infer ratio mask (``icepop``)
``decoupled_ppo``       AReaL's decoupled PPO with a proximal policy (``decoupled_ppo``)
``m2po``                M2PO's second-moment mask (``m2po``)
``cispo``               MiniMax-M1's clipped IS weights, gradient on every token (``cispo``)
======================  ====================================================================

**Adding an objective** is its module (exposing ``OBJECTIVES``, a tuple of objects following the
protocol, each naming its settings record, whose fields :func:`~.base.setting` declares), one
``AsyncGRPOConfig`` line per new setting (a test names a missing one), its tests (a brute-force
reference and a negative control in ``tests/core/test_objectives.py``) and one line in
:data:`_MODULES` below.

Example:
    >>> objective_for(loss_type_from(None, score_centering=True)).needs.sampler_topk
    True
    >>> objective_for("clipped_surrogate").needs.sampler_topk
    False
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from asyncgrpo.core.loss.objectives.base import (
    Needs,
    Objective,
    ObjectiveSettings,
    Setting,
    TokenInputs,
    settings_for,
    settings_of,
)
from asyncgrpo.core.names import did_you_mean

_MODULES = (
    "score_centering",
    "clipped_surrogate",
    "tis",
    "mis",
    "icepop",
    "decoupled_ppo",
    "m2po",
    "cispo",
)
"""The registry: the modules under ``asyncgrpo.core.loss.objectives`` whose ``OBJECTIVES`` are
registered, in this order."""


def _registry() -> dict[str, Objective[Any]]:
    registry: dict[str, Objective[Any]] = {}
    for module in _MODULES:
        for objective in import_module(f"{__name__}.{module}").OBJECTIVES:
            if objective.name in registry:
                raise ValueError(f"two objectives are named {objective.name!r}")
            registry[objective.name] = objective
    return registry


OBJECTIVES: dict[str, Objective[Any]] = _registry()
"""Every objective by its ``loss_type`` name."""


SETTINGS_TYPES: tuple[type[ObjectiveSettings], ...] = tuple(
    dict.fromkeys(objective.settings_type for objective in OBJECTIVES.values())
)
"""Every objective's settings record, once each, in registry order."""


def _declared_settings() -> tuple[Setting, ...]:
    declared: dict[str, Setting] = {}
    for settings_type in SETTINGS_TYPES:
        for setting in settings_of(settings_type):
            if declared.setdefault(setting.name, setting) != setting:
                raise ValueError(
                    f"two settings records declare {setting.name!r} differently; declare it "
                    "once, in a record the objectives that read it extend"
                )
    return tuple(declared.values())


SETTINGS: tuple[Setting, ...] = _declared_settings()
"""Every objective setting, once, in registry order: the shared ones (the trust region and TRL's
keep range, :mod:`.weights`) first. ``AsyncGRPOConfig`` has one field per entry, under its name.
"""


def objective_for(name: str) -> Objective:
    """The objective registered as ``name``; a ValueError lists the valid names and the closest.

    Example:
        >>> objective_for("score_centring")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: unknown loss_type 'score_centring' (did you mean 'score_centering'?); valid: ...
    """
    try:
        return OBJECTIVES[name]
    except KeyError:
        pass
    raise ValueError(
        f"unknown loss_type {name!r}{did_you_mean(name, OBJECTIVES, cutoff=0.0)}; valid: "
        f"{', '.join(sorted(OBJECTIVES))}"
    ) from None


def loss_type_from(loss_type: str | None, score_centering: bool) -> str:
    """The ``loss_type`` a config means, from ``loss_type`` and TRL's ``score_centering``.

    TRL's AsyncGRPOConfig chooses its objective with the boolean ``score_centering``: True (its
    default) is score centering, False the clipped surrogate. Without a ``loss_type`` that choice
    stands. With one, ``loss_type`` decides; ``score_centering=True`` (TRL's default, so it cannot
    tell "not set" apart) is ignored, and ``score_centering=False``, which TRL documents as
    "use the clipped surrogate", must agree: with any other ``loss_type`` it raises.

    Example:
        >>> loss_type_from(None, True), loss_type_from(None, False)
        ('score_centering', 'clipped_surrogate')
        >>> loss_type_from("clipped_surrogate", True)
        'clipped_surrogate'
        >>> loss_type_from("score_centering", False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: score_centering=False selects TRL's clipped surrogate but loss_type is ...
    """
    if loss_type is None:
        return "score_centering" if score_centering else "clipped_surrogate"
    objective_for(loss_type)
    if not score_centering and loss_type != "clipped_surrogate":
        raise ValueError(
            f"score_centering=False selects TRL's clipped surrogate but loss_type is "
            f"{loss_type!r}; drop score_centering (loss_type decides) or set "
            "loss_type='clipped_surrogate'"
        )
    return loss_type


__all__ = [
    "OBJECTIVES",
    "SETTINGS",
    "SETTINGS_TYPES",
    "Needs",
    "Objective",
    "ObjectiveSettings",
    "Setting",
    "TokenInputs",
    "loss_type_from",
    "objective_for",
    "settings_for",
    "settings_of",
]
