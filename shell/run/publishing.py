"""Where the trained policy goes: ``save_model``, ``push_to_hub`` and the hub pushes after
checkpoints, as transformers' ``Trainer`` offers them.

:class:`Publisher` is held by :class:`~asyncgrpo.shell.run.trainer.AsyncGRPOTrainer`, which
delegates its ``save_model`` and ``push_to_hub`` to it. Before ``train()`` the policy is the
model as given; during ``train()`` (a callback) the learner's current policy; after it, the
trained policy (:class:`FinalModel`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from transformers.trainer_utils import HubStrategy

from asyncgrpo.adapters.process_group import launch_rank
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.run import checkpoints, hub


@attrs.frozen
class FinalModel:
    """Where the trained policy is after ``train()``: the exported model's directory, and for
    PEFT the adapter weights (rank 0) and the ``PeftModel`` that writes them."""

    model_dir: Path
    rank: int
    adapter: dict[str, Any] | None
    peft_model: Any

    @classmethod
    def of(cls, learner: Learner, model_dir: Path) -> FinalModel:
        """The learner's policy after training, exported to ``model_dir`` (collective)."""
        adapter = learner.export.adapter_state_dict() if learner.is_peft else None
        return cls(model_dir, learner.rank, adapter, learner.model if learner.is_peft else None)


class Publisher:
    """Saves and uploads the policy.

    Args:
        args: the run's config (``output_dir``, the ``hub_*`` fields); replace it when a trial
            changes the config.
        model: the model as given to the trainer (saved before ``train()``).
        processing_class: the tokenizer, saved beside every model.
        model_name: the model's name or path, for the model card.
    """

    def __init__(
        self, args: AsyncGRPOConfig, model: Any, processing_class: Any, model_name: str
    ) -> None:
        self.args = args
        self.model = model
        self.processing_class = processing_class
        self.model_name = model_name
        self.learner: Learner | None = None  # inside train()
        self.final: FinalModel | None = None  # after train()

    @property
    def output_dir(self) -> Path:
        return self.args.output_path

    def save_model(self, output_dir: str | None = None) -> None:
        """Write the policy so ``from_pretrained`` loads it, with the tokenizer; rank 0 writes.

        The model (``AutoModelForCausalLM.from_pretrained(output_dir)``), or with a
        ``peft_config`` the adapter (``PeftModel.from_pretrained``). Inside ``train()`` it is
        collective: every rank calls it."""
        path = Path(output_dir) if output_dir else self.args.output_path
        if self.learner is not None:
            self.learner.export.save_pretrained(
                path, self.processing_class, adapter_only=self.learner.is_peft
            )
            return
        final = self.final
        if (final.rank if final is not None else launch_rank()) != 0:
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
        if self.final is not None and self.final.rank != 0:
            return None
        hub.write_model_card(self.output_dir, self.model_name, **kwargs)
        return hub.upload(
            self.args,
            self.output_dir,
            commit_message=commit_message or "",
            token=token,
            revision=revision,
            blocking=blocking,
        )

    def after_checkpoint(self, step: int, rank0: bool) -> None:
        """Push to the hub after a checkpoint as ``hub_strategy`` says (``push_to_hub``)."""
        if not self.args.push_to_hub:
            return
        strategy = HubStrategy(self.args.hub_strategy).value
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
