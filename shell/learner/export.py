"""The learner's weights read back whole: for weight sync, ``save_pretrained`` and the final
model.

:class:`WeightExport` reads a learner's FSDP2-sharded model back whole (the learner holds one
as ``learner.export``): every export is a collective over the trainer's processes, and rank 0
gets the weights, in :attr:`WeightExport.export_dtype`
(bf16 under bf16 training, as TRL's AsyncGRPOTrainer documentation says). With PEFT the
exported weights are the merged ones under the base model's keys, unless the adapters alone are
asked for.

A PEFT run whose server refused adapters (no ``--enable-lora``) pushes merged weights; once the
weight sync calls :meth:`WeightExport.check_merged_pushes` with the server's dtype, every merged
push counts the entries of the LoRA update that rounding to the export dtype and the server's
dtype loses, and raises :class:`LoraPrecisionError` when more than half are lost
(:mod:`asyncgrpo.core.weights.lora_precision`): the server would sample from a policy the
trainer does not hold. The refusal comes before the push sends anything (:meth:`iter_weights`
counts when called, gathering and merging one tensor at a time on the device, and the engine's
stream calls it before its send starts), so a server is never left waiting mid-receive. The
count adds two casts and two comparisons of at most 65,536 sampled entries per adapted matrix
to the merge (costs in docs/weight_sync.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import PeftModel
from torch import Tensor
from transformers import PreTrainedModel

from asyncgrpo.adapters.kernels.packed_forward import base_model
from asyncgrpo.adapters.models.causal_lm import checkpoint_named, save_weights_as_model
from asyncgrpo.adapters.models.fsdp import gathered_state_dict, iter_full_tensors, meta_state_dict
from asyncgrpo.adapters.models.lora import (
    adapter_state_dict,
    merged_state_dict,
    merged_tensors,
    merged_with_lost_update,
)
from asyncgrpo.adapters.models.vision_language import frozen_prefixes, is_synced_weight
from asyncgrpo.adapters.process_group import decided_on_rank0
from asyncgrpo.core.weights.lora_precision import (
    TORCH_DTYPES,
    UpdateCounts,
    check_merged_sync,
)
from asyncgrpo.core.weights.parity import dtype_name


class LoraPrecisionError(RuntimeError):
    """A merged push of a PEFT model whose LoRA update the server's dtype cannot hold."""


class WeightExport:
    """The weights of a learner's sharded ``model``, read back whole.

    Args:
        model: the FSDP2-sharded model (a ``PeftModel`` with LoRA).
        rank: this process's rank; rank 0 receives what is gathered.
        device: the learner's device (where :meth:`iter_weights` yields).
        bf16: bf16 mixed-precision training: exports are in bf16.
    """

    def __init__(
        self, model: PreTrainedModel | PeftModel, rank: int, device: torch.device, bf16: bool
    ) -> None:
        self.model = model
        self.rank = rank
        self.device = device
        self.bf16 = bf16
        self.merged_checked = False  # check_merged_pushes was called
        self.server_dtype: str | None = None  # the servers' dtype then (None: they did not say)

    @property
    def is_peft(self) -> bool:
        return isinstance(self.model, PeftModel)

    @property
    def export_dtype(self) -> torch.dtype:
        """The dtype of exported weights: bf16 under bf16 training, else the weights' own."""
        if self.bf16:
            return torch.bfloat16
        return next(p for p in self.model.parameters() if p.is_floating_point()).dtype

    def full_state_dict(self) -> dict[str, Tensor]:
        """The unsharded model weights on the CPU in :attr:`export_dtype`, for weight sync.

        With PEFT, the merged weights under the base model's keys (see
        :meth:`adapter_state_dict` for the adapters alone). Collective: every process must
        call it; rank 0 gets the weights, the others an empty dict.
        """
        full = gathered_state_dict(self.model)
        if self.rank != 0:
            return {}
        if isinstance(self.model, PeftModel):
            full = merged_state_dict(self.model, full)
        return {k: self._exported(v) for k, v in full.items()}

    def check_merged_pushes(self, server_dtype: str | None) -> None:
        """Check every later :meth:`synced_state_dict` of a PEFT model against the servers'
        dtype (``/server_info``'s ``model_config.dtype``; ``None``: the servers did not say,
        counted as bfloat16): weight sync calls it when it pushes merged weights."""
        self.merged_checked = True
        self.server_dtype = server_dtype

    def synced_state_dict(self) -> dict[str, Tensor]:
        """:meth:`full_state_dict` without the weights that never change (a vision-language
        model's frozen vision tower), under the checkpoint's names (:func:`checkpoint_named`):
        what weight sync sends. Collective, like it.

        Raises:
            LoraPrecisionError: on every rank, after :meth:`check_merged_pushes`, when the
                servers' dtype (or :attr:`export_dtype`) loses more than half of the LoRA
                update (:func:`~asyncgrpo.core.weights.lora_precision.check_merged_sync`).
        """
        prefixes = frozen_prefixes(self.model)
        pushed = self._checked_merge() if self.is_peft and self.merged_checked else None
        return {
            converted_name: converted
            for name, tensor in (self.full_state_dict() if pushed is None else pushed).items()
            if is_synced_weight(name, prefixes)
            for converted_name, converted in self._checkpoint_named({name: tensor}).items()
        }

    def _checked_merge(self) -> dict[str, Tensor]:
        """:meth:`full_state_dict` of a PEFT model, the merge counted and checked
        (collective; every rank gets rank 0's verdict)."""
        full = gathered_state_dict(self.model)
        merged: dict[str, Tensor] = {}
        counts = UpdateCounts()
        if self.rank == 0:
            server = TORCH_DTYPES[dtype_name(self.server_dtype)]
            merged, counts = merged_with_lost_update(
                self._peft_model(), full, (self.export_dtype, server)
            )
        check = decided_on_rank0(
            lambda: check_merged_sync(counts, self.server_dtype, str(self.export_dtype))
        )
        if check.refused:
            raise LoraPrecisionError(check.message)
        return {k: self._exported(v) for k, v in merged.items()}

    def _checkpoint_named(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        return checkpoint_named(base_model(self.model), weights)

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, full shape)`` of each tensor :meth:`iter_weights` yields, in order,
        without gathering anything (the same keys, dtypes and order as
        :meth:`synced_state_dict`). Local: any process may call it alone."""
        shapes = meta_state_dict(self.model, self._is_synced)
        if isinstance(self.model, PeftModel):
            shapes = merged_state_dict(self.model, shapes)
        return [
            (converted_name, self._exported(converted).dtype, tuple(converted.shape))
            for name, tensor in shapes.items()
            for converted_name, converted in self._checkpoint_named({name: tensor}).items()
        ]

    def iter_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The unsharded weights one tensor at a time, on the learner's device, in
        :attr:`export_dtype`: what :meth:`full_state_dict` holds, without a CPU copy of the
        whole model.

        Collective: every process iterates it to the end in step (each tensor is all-gathered);
        rank 0 gets the weights. With PEFT each tensor is merged with its adapters on the
        device as it is gathered (the adapters, small, are gathered first, by this call); after
        :meth:`check_merged_pushes` this call first goes once over every merged tensor to
        count what rounding loses (a collective every process makes here), so that a refusal
        comes before anything is yielded.

        Raises:
            LoraPrecisionError: from this call itself, not from the iteration, on every rank,
                where :meth:`synced_state_dict` refuses the merge: a weight sync that calls it
                before its send refuses before anything reaches a server.
        """
        if self.is_peft:
            lora_state = dict(iter_full_tensors(self.model, _is_lora))  # the adapters: small
            if self.merged_checked:
                self._check_merge(lora_state)
            return self._iter_merged_weights(lora_state)
        return self._iter_full_weights()

    def _check_merge(self, lora_state: dict[str, Tensor]) -> None:
        """Count what rounding loses of the LoRA update over every merged tensor, gathered
        and merged one at a time on the device (collective), and refuse on every rank as
        :meth:`synced_state_dict` does."""
        server = TORCH_DTYPES[dtype_name(self.server_dtype)]
        counts = UpdateCounts()
        for _, _, lost in merged_tensors(
            self._peft_model(),
            iter_full_tensors(self.model, self._is_synced),
            lora_state,
            (self.export_dtype, server),
        ):
            counts += lost
        check = decided_on_rank0(
            lambda: check_merged_sync(counts, self.server_dtype, str(self.export_dtype))
        )
        if check.refused:
            raise LoraPrecisionError(check.message)

    def _iter_merged_weights(self, lora_state: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
        tensors = iter_full_tensors(self.model, self._is_synced)
        for name, merged, _ in merged_tensors(self._peft_model(), tensors, lora_state):
            yield from self._checkpoint_named({name: self._exported(merged)}).items()

    def _iter_full_weights(self) -> Iterator[tuple[str, Tensor]]:
        for name, full in iter_full_tensors(self.model, self._is_synced):
            yield from self._checkpoint_named({name: self._exported(full)}).items()

    def _is_synced(self, name: str) -> bool:
        return is_synced_weight(name, frozen_prefixes(self.model))

    def _exported(self, tensor: Tensor) -> Tensor:
        return tensor.to(self.export_dtype) if tensor.is_floating_point() else tensor

    def adapter_state_dict(self) -> dict[str, Tensor]:
        """The LoRA adapter weights under peft's saved keys (collective; rank 0 gets them)."""
        model = self._peft_model()
        full = gathered_state_dict(model)
        return adapter_state_dict(model, full) if self.rank == 0 else {}

    def _peft_model(self) -> PeftModel:
        """The model, which must be a ``PeftModel``.

        Raises:
            ValueError: the learner trains the whole model (no ``peft_config``).
        """
        if not isinstance(self.model, PeftModel):
            raise ValueError(
                "the adapters and their merge need a Learner built with peft_config (LoRA)"
            )
        return self.model

    def save_pretrained(
        self, path: str | Path, tokenizer: Any = None, *, adapter_only: bool = False
    ) -> None:
        """Write the model (merged for PEFT) so ``AutoModelForCausalLM.from_pretrained(path)``
        loads it, or with ``adapter_only`` the PEFT adapter (``PeftModel.from_pretrained``);
        and the tokenizer when given. Collective; rank 0 writes."""
        if adapter_only and not self.is_peft:
            raise ValueError("save_pretrained(adapter_only=True) needs a Learner with peft_config")
        path = Path(path)
        if adapter_only:
            full = gathered_state_dict(self.model)
            if self.rank == 0:
                self.model.save_pretrained(str(path), state_dict=full)
        else:
            weights = self.full_state_dict()
            if self.rank == 0:
                base = base_model(self.model)
                save_weights_as_model(base, weights, path, self.export_dtype)
        if self.rank == 0 and tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        dist.barrier()


def _is_lora(name: str) -> bool:
    """A LoRA adapter's entry of a PEFT model's state dict."""
    return ".lora_" in name
