"""The transformers-Trainer surface of :class:`~asyncgrpo.AsyncGRPOTrainer`: callbacks,
``train(trial=...)``, ``save_model`` and ``push_to_hub``.

A mixin: the trainer holds ``args``, ``model``, ``processing_class``, ``model_name``,
``output_dir``, ``_callbacks`` (:class:`~asyncgrpo.shell.run.callbacks.Callbacks`), ``_run`` (the
running ``train()`` call, or None) and ``_final`` (where the trained policy is after it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from transformers import TrainerCallback, TrainerState, enable_full_determinism, set_seed
from transformers.trainer_callback import CallbackHandler

from asyncgrpo.shell.config import AsyncGRPOConfig, field_names
from asyncgrpo.shell.config import rules as config_rules
from asyncgrpo.shell.run import checkpoints, hub

_FIXED_AT_CONSTRUCTION = ("model_init_kwargs", "dtype", "trust_remote_code")
"""Config fields used when the trainer is built (loading the model), not by train()."""


@attrs.frozen
class FinalModel:
    """Where the trained policy is after ``train()``: the exported model's directory, and for
    PEFT the adapter weights (rank 0) and the ``PeftModel`` that writes them."""

    model_dir: Path
    rank: int
    adapter: dict[str, Any] | None
    peft_model: Any


def seed_everything(config: AsyncGRPOConfig) -> None:
    """Seed python, numpy and torch as transformers' Trainer does: fully deterministic
    algorithms under ``full_determinism``."""
    if config.full_determinism:
        enable_full_determinism(config.seed)
    else:
        set_seed(config.seed)


class TrainerAPI:
    """Callbacks, trials, saving and the hub, as transformers' ``Trainer`` offers them."""

    # ----------------------------------------------------------------- callbacks

    @property
    def callback_handler(self) -> CallbackHandler:
        """transformers' ``CallbackHandler`` holding the callbacks."""
        return self._callbacks.handler

    @property
    def state(self) -> TrainerState:
        """The ``TrainerState`` the callbacks see (``global_step``, ``log_history``, ...)."""
        return self._callbacks.state

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self._callbacks.handler.add_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> Any:
        return self._callbacks.handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self._callbacks.handler.remove_callback(callback)

    def _apply_trial(self, trial: Mapping[str, Any] | Any) -> None:
        params = dict(trial) if isinstance(trial, Mapping) else dict(trial.params)
        known = field_names(type(self.args))
        for name in params:
            if name not in known:
                raise ValueError(f"trial sets {name!r}, which is not an AsyncGRPOConfig field"
                                 + config_rules.closest(name, known))  # fmt: skip
            if name in _FIXED_AT_CONSTRUCTION:
                raise ValueError(
                    f"trial sets {name!r}, which takes effect when the trainer is built (the "
                    "model is loaded): build a trainer per value"
                )
        self.args = dataclasses.replace(self.args, **params)
        self.output_dir = Path(self.args.output_dir)
        self._callbacks.args = self.args
        self._callbacks.state.trial_params = params
        seed_everything(self.args)

    # ----------------------------------------------------------------- saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the policy so ``from_pretrained`` loads it, with the tokenizer; rank 0 writes.

        The model (``AutoModelForCausalLM.from_pretrained(output_dir)``), or with a
        ``peft_config`` the adapter (``PeftModel.from_pretrained``). Before ``train()`` it is
        the model as given; inside ``train()`` (a callback) the current policy (collective:
        every rank calls it); after ``train()`` the trained policy."""
        path = Path(output_dir or self.args.output_dir)
        if self._run is not None:
            learner = self._run.learner
            learner.save_pretrained(path, self.processing_class, adapter_only=learner.is_peft)
            return
        final = self._final
        if final is not None and final.rank != 0:
            return
        path.mkdir(parents=True, exist_ok=True)
        if final is None:
            self.model.save_pretrained(str(path))
        elif final.adapter is not None:
            final.peft_model.save_pretrained(str(path), state_dict=final.adapter)
        elif path.resolve() != final.model_dir.resolve():
            from transformers import AutoModelForCausalLM

            trained = AutoModelForCausalLM.from_pretrained(str(final.model_dir), dtype="auto")
            trained.save_pretrained(str(path))
        self.processing_class.save_pretrained(str(path))

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Save the model to ``output_dir`` and upload it to ``hub_model_id`` with
        ``huggingface_hub`` (rank 0); ``kwargs`` (``model_name``, ``license``, ``tags``,
        ``dataset_name``, ...) go to the model card (README.md).

        Returns:
            huggingface_hub's ``CommitInfo`` (a ``Future`` of it when not ``blocking``), or
            None on other ranks.
        """
        hub.resolve_token(self.args, token)
        self.save_model(self.args.output_dir)
        if self._final is not None and self._final.rank != 0:
            return None
        hub.write_model_card(self.output_dir, self.model_name, **kwargs)
        return hub.upload(self.args, self.output_dir, commit_message=commit_message or "",
                          token=token, revision=revision, blocking=blocking)  # fmt: skip

    def _after_save(self, step: int, rank0: bool) -> None:
        """Push to the hub after a checkpoint as ``hub_strategy`` says (``push_to_hub``)."""
        if not self.args.push_to_hub:
            return
        strategy = self.args.hub_strategy.value
        if strategy == "end":
            return
        self.save_model(self.args.output_dir)
        if not rank0:
            return
        message = f"Training in progress, step {step}"
        hub.upload(self.args, self.output_dir, commit_message=message)
        checkpoint = self.output_dir / f"{checkpoints.CHECKPOINT_PREFIX}{step}"
        if strategy in ("checkpoint", "all_checkpoints"):
            folder = "last-checkpoint" if strategy == "checkpoint" else checkpoint.name
            hub.upload(self.args, checkpoint, commit_message=message, path_in_repo=folder)
