"""The learner's optimizer and learning-rate schedule, built from the config as transformers'
``Trainer`` builds them, or the user's own (TRL's ``optimizers`` argument) pointed at the
sharded parameters.
"""

from __future__ import annotations

import math

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import get_scheduler

from asyncgrpo.shell.config import AsyncGRPOConfig


def build_optimizer(model: nn.Module, config: AsyncGRPOConfig) -> Optimizer:
    """``config.optim`` over the trainable parameters, as transformers' ``Trainer`` builds it
    (``Trainer.get_optimizer_cls_and_kwargs``: learning rate, betas, epsilon, ``optim_args``);
    no weight decay on 1-D parameters (biases, norms)."""
    from transformers import Trainer

    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(config)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    return optimizer_cls([g for g in groups if g["params"]], **kwargs)


def build_scheduler(optimizer: Optimizer, config: AsyncGRPOConfig) -> LRScheduler:
    """``transformers.get_scheduler(config.lr_scheduler_type)`` with the config's warmup and
    ``lr_scheduler_kwargs``.

    ``warmup_steps`` below 1 is a fraction of ``max_steps``, as in transformers.
    """
    total = config.max_steps if config.max_steps > 0 else None
    warmup = config.warmup_steps
    if 0 < warmup < 1:
        if total is None:
            raise ValueError(
                f"AsyncGRPOConfig.warmup_steps={warmup} is a fraction of max_steps, which is "
                "not set: set max_steps, or give warmup_steps as a number of steps"
            )
        warmup = math.ceil(warmup * total)
    return get_scheduler(
        config.lr_scheduler_type,
        optimizer,
        num_warmup_steps=int(warmup),
        num_training_steps=total,
        scheduler_specific_kwargs=config.lr_scheduler_kwargs or None,
    )


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name``, to find a user optimizer's parameters after sharding."""
    return {id(p): name for name, p in model.named_parameters()}


def rebind_optimizer(optimizer: Optimizer, names: dict[int, str], model: nn.Module) -> None:
    """Point ``optimizer`` at ``model``'s sharded parameters (FSDP2 replaces them).

    Raises:
        ValueError: the optimizer already has state, or holds a parameter not in the model.
    """
    if optimizer.state:
        raise ValueError(
            "optimizers: the optimizer already has state; pass a fresh one (its state is "
            "restored by load_checkpoint)"
        )
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                "optimizers: the optimizer holds parameters that are not the model's; build it "
                "over model.parameters() of the model passed to the Learner"
            )
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]


def optimizers_for(
    model: nn.Module,
    config: AsyncGRPOConfig,
    given: tuple[Optimizer | None, LRScheduler | None],
    names: dict[int, str],
) -> tuple[Optimizer, LRScheduler]:
    """The user's ``(optimizer, scheduler)`` rebound to the sharded ``model`` (``names`` taken
    before sharding), with the config's default for each that is None."""
    optimizer, scheduler = given
    if optimizer is None:
        optimizer = build_optimizer(model, config)
    else:
        rebind_optimizer(optimizer, names, model)
    return optimizer, scheduler or build_scheduler(optimizer, config)
