"""The learner's optimizer and learning-rate schedule, built from the config as transformers'
``Trainer`` builds them, or the user's own (TRL's ``optimizers`` argument) pointed at the
sharded parameters.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import get_scheduler

from asyncgrpo.adapters.models.fsdp import clip_gradients, weights_finite
from asyncgrpo.core.metrics import Observation, mean, total
from asyncgrpo.core.run.divergence import (
    NONFINITE_STEP_COUNT,
    step_is_finite,
    weights_diverged_message,
)
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner.failures import DivergedError


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
        scheduler_specific_kwargs=config.keyword_arguments("lr_scheduler_kwargs") or None,
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


@attrs.frozen
class AppliedStep:
    """What :func:`optimizer_step` did, alike on every process.

    Attributes:
        loss: the step's loss, summed over processes and micro-batches.
        grad_norm: the gradient norm over every process, before clipping (NaN on every
            process when it was not finite on one).
        skipped: the loss or the norm was not finite, so the optimizer did not step.
    """

    loss: float
    grad_norm: float
    skipped: bool

    def observations(self, learning_rate: float) -> list[Observation]:
        """The step's figures for its metric window: ``loss`` and ``grad_norm`` of a step
        applied, the learning rate and :data:`~asyncgrpo.core.run.divergence.
        NONFINITE_STEP_COUNT` of every step."""
        figures = [
            total(NONFINITE_STEP_COUNT, int(self.skipped)),
            mean("learning_rate", learning_rate),
        ]
        if not self.skipped:
            figures += [mean("loss", self.loss), mean("grad_norm", self.grad_norm)]
        return figures


def optimizer_step(
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    config: AsyncGRPOConfig,
    loss_sum: Tensor,
    step: int,
) -> AppliedStep:
    """Clip the gradients to ``max_grad_norm`` and step the optimizer and the schedule, unless
    the loss or the gradient norm is not finite (:mod:`asyncgrpo.core.run.divergence`): then
    neither steps and the weights and the optimizer's state stay as they were. The gradients
    are zeroed either way (collective: every process decides alike).

    Args:
        loss_sum: this process's loss of the step (summed over its micro-batches).
        step: the step's number, for the error.

    Raises:
        DivergedError: the optimizer step, on finite gradients, made the weights non-finite;
            they must not reach the server or a checkpoint.
    """
    loss, grad_norm = _agreed(loss_sum, clip_gradients(model, config.max_grad_norm))
    finite = step_is_finite(loss, grad_norm)
    if finite:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if finite and not weights_finite(model):
        message = weights_diverged_message(
            step, config.learning_rate, config.max_grad_norm, str(config.output_path)
        )
        raise DivergedError(message)
    return AppliedStep(loss, grad_norm, skipped=not finite)


def _agreed(loss_sum: Tensor, grad_norm: float) -> tuple[float, float]:
    """The step's loss summed over processes and its gradient norm, alike on every process
    (one all-reduce): a norm not finite on one process is NaN on all, so every process makes
    the same decision."""
    local = [float(loss_sum), 0.0 if math.isfinite(grad_norm) else 1.0]
    both = torch.tensor(local, dtype=torch.float64, device=loss_sum.device)
    dist.all_reduce(both)
    loss, nonfinite_norms = both.tolist()
    return loss, grad_norm if nonfinite_norms == 0 else math.nan
