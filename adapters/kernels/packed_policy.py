"""The learner's policy over packed rows: the FSDP2 root module, the MoE auxiliary loss, and the
tensors a row's loss needs besides its tokens.

:class:`PackedPolicy` wraps a causal LM so that its forward is
:func:`~asyncgrpo.adapters.kernels.packed_forward.packed_log_probs` on one packed row; sharded as
the FSDP2 root (:func:`asyncgrpo.adapters.models.fsdp.shard`), the parameters outside the decoder
layers are gathered once per row however many LM-head chunks the row has.

**MoE.** For a Mixture-of-Experts model :class:`RouterAuxLoss` captures the router logits of
every layer during the packed forward; the learner adds transformers' load-balancing loss of the
row times ``router_aux_loss_coef`` (the model config's value unless the run's config sets one),
averaged over the micro-batch's rows on all processes and over the micro-batches.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import numpy as np
import torch
from peft import PeftModel
from torch import Tensor, nn
from transformers import PreTrainedModel

from asyncgrpo.adapters.kernels.architecture_support import TrainingPath
from asyncgrpo.adapters.kernels.backends import BackendChoice
from asyncgrpo.adapters.kernels.layout import Backend
from asyncgrpo.adapters.kernels.packed_forward import packed_log_probs
from asyncgrpo.adapters.kernels.per_sample_forward import per_sample_log_probs
from asyncgrpo.core.loss.inputs import SamplerTopK
from asyncgrpo.core.packing.sample_batch import real_positions
from asyncgrpo.core.packing.tree import PackedRow, pack_row
from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.core.sampler_tables import TopLogprobs


class PackedPolicy(nn.Module):
    """The FSDP2 root: its forward is :func:`packed_log_probs` on one row, or
    :func:`per_sample_log_probs` for a model on the per-sample ``path``.

    Returns ``(logp [N], entropy [N], topk_logp [N, K] or None)`` in nats, as tensors so that
    FSDP2 hooks its backward.
    """

    def __init__(
        self,
        model: PreTrainedModel | PeftModel,
        temperature: float,
        chunk_size: int,
        backend: Backend | BackendChoice | None,
        path: TrainingPath,
    ) -> None:
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.backend = backend
        self.path = path

    def forward(
        self, row: PackedRow, topk: SamplerTopK | None, candidate_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        if self.path.kind == "per_sample":
            out = per_sample_log_probs(
                self.model, row, self.temperature, topk=topk, candidate_mask=candidate_mask
            )
            return out.logp, out.entropy, out.topk_logp
        out = packed_log_probs(
            self.model,
            row,
            self.temperature,
            topk=topk,
            candidate_mask=candidate_mask,
            chunk_size=self.chunk_size,
            backend=self.backend,
        )
        return out.logp, out.entropy, out.topk_logp

    def forwarded_tokens(self, row: PackedRow) -> Tensor | None:
        """long [T]: where ``row``'s real tokens lie among the positions a forward of it runs,
        flattened (what token-wise outputs such as router logits hold beyond them is padding);
        None when the forward runs the row's tokens alone (the tree)."""
        if self.path.kind == "tree":
            return None
        device = next(self.model.parameters()).device
        lengths = np.array([len(sample.sequence) for sample in row.samples], dtype=np.int64)
        return torch.tensor(real_positions(lengths), device=device)


# --- MoE router auxiliary loss -------------------------------------------------------------


@attrs.define
class RouterAuxLoss:
    """The load-balancing loss of a Mixture-of-Experts model over one packed row.

    Forward hooks on the router modules (those transformers records as ``router_logits``)
    collect each layer's router logits [T, E] while :meth:`capture` is active (not during the
    activation-checkpointing recomputation), and :meth:`loss` applies the model's own
    ``load_balancing_loss_func``.

    Attributes:
        coef: ``router_aux_loss_coef``.
        loss_fn: ``load_balancing_loss_func(gate_logits, num_experts, top_k)``.
        num_experts: experts per layer.
        top_k: experts each token is routed to.
        output_index: where the router logits sit in a router's output tuple.
        captured: the router logits collected inside :meth:`capture`, None outside it.
    """

    coef: float
    loss_fn: Callable[..., Tensor]
    num_experts: int
    top_k: int
    output_index: int
    captured: list[Tensor] | None = None

    @classmethod
    def for_model(cls, model: PreTrainedModel, coef: float | None) -> RouterAuxLoss | None:
        """The aux loss of ``model`` with ``coef`` (None: the model config's value), or None
        for a dense model or a zero coefficient.

        Raises:
            ValueError: ``coef`` is set but ``model`` is not a Mixture-of-Experts model.
        """
        recorder = getattr(model, "_can_record_outputs", None) or {}
        recorder = recorder.get("router_logits")
        loss_fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        if recorder is None or loss_fn is None or recorder.target_class is None:
            if coef is not None:
                raise ValueError(
                    f"AsyncGRPOConfig.router_aux_loss_coef is {coef} but {type(model).__name__} "
                    "is not a Mixture-of-Experts model with router logits: leave it None"
                )
            return None
        coef = getattr(model.config, "router_aux_loss_coef", 0.0) if coef is None else coef
        if not coef:
            return None
        config = model.config
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        aux = cls(float(coef), loss_fn, int(experts), config.num_experts_per_tok, recorder.index)
        # transformers' own rule: the class, and the layer name where the recorder gives one
        # (Jamba records every nn.Linear named "router")
        named = None if recorder.layer_name is None else f".{recorder.layer_name.strip('.')}."
        for name, module in model.named_modules():
            if isinstance(module, recorder.target_class) and (
                named is None or named in f".{name}."
            ):
                module.register_forward_hook(aux._record)
        return aux

    def _record(self, module: nn.Module, inputs: Any, output: Any) -> None:
        # no tensor operation here: inside a checkpointed layer it would save tensors that the
        # recomputation (outside capture) does not, which activation checkpointing refuses
        if self.captured is not None:
            self.captured.append(output[self.output_index] if isinstance(output, tuple) else output)

    @contextmanager
    def capture(self, tokens: Tensor | None = None) -> Iterator[list[Tensor]]:
        """Collect the router logits [T, E] of the forwards run inside the block; with
        ``tokens`` (long [T], see :meth:`PackedPolicy.forwarded_tokens`), when the block ends,
        only those rows of each layer's flattened logits, so that padding is not counted as
        routed tokens."""
        captured: list[Tensor] = []
        self.captured = captured
        try:
            yield captured
        finally:
            self.captured = None
        if tokens is not None:
            captured[:] = [logits.reshape(-1, logits.shape[-1])[tokens] for logits in captured]

    def loss(self, router_logits: Sequence[Tensor]) -> Tensor:
        """The unscaled load-balancing loss (a scalar with grad) of one row."""
        return self.loss_fn(tuple(router_logits), self.num_experts, self.top_k)


# --- rows to tensors -----------------------------------------------------------------------


def sampler_topk(row: PackedRow, k: int, device: torch.device) -> SamplerTopK:
    """The sampler's ``k`` most probable tokens at each trained token of ``row``.

    The row's tables (already most probable first) are cut to their first ``k`` entries and
    padded with ``valid=False`` entries: ids long [N, k], logp float [N, k] (nats), valid
    bool [N, k].

    Raises:
        ValueError: a trained token has no table (score centering needs them all).
    """
    n = len(row.target_ids)
    top = row.sampler_top_logprobs
    if top is None:
        top = TopLogprobs.missing(n)
    missing = np.flatnonzero(top.counts < 0)
    if len(missing):
        raise ValueError(_missing_topk_message(row, int(missing[0])))
    width = min(k, top.ids.shape[1])
    ids = np.zeros((n, k), np.int64)
    logp = np.zeros((n, k), np.float32)
    valid = np.arange(k) < np.minimum(top.counts, k)[:, None]
    ids[:, :width], logp[:, :width] = top.ids[:, :width], top.logprobs[:, :width]
    ids[~valid], logp[~valid] = 0, 0.0
    return SamplerTopK(
        torch.from_numpy(ids).to(device),
        torch.from_numpy(logp).to(device),
        torch.from_numpy(valid).to(device),
    )


def empty_sampler_topk(k: int, device: torch.device) -> SamplerTopK:
    """One position with ``k`` invalid entries: the top-k table of :func:`dummy_row`."""
    empty = torch.zeros(1, k, dtype=torch.long, device=device)
    return SamplerTopK(empty, empty.float(), empty.bool())


def _missing_topk_message(row: PackedRow, token: int) -> str:
    sample = row.samples[int(row.sample_index[token])]
    return (
        f"score_centering=True needs the sampler's top log-probs at every trained token, but "
        f"sample {sample.rollout_id!r} has none (TrainingSequence.sampler_top_logprobs): "
        "request num_sampler_logprobs from the server, or set score_centering=False"
    )


def candidate_mask(row: PackedRow, vocab_size: int, device: torch.device) -> Tensor | None:
    """bool [N, V]: the sampler's candidate set at each trained token (all True where a token
    has none), or None when no sample of ``row`` carries candidate sets. Memory: N x V bytes."""
    sets = row.candidate_sets
    if sets is None:
        return None
    mask = np.zeros((len(row.target_ids), vocab_size), bool)
    mask[sets.counts < 0] = True
    positions, entries = np.nonzero(sets.valid())
    mask[positions, sets.ids[positions, entries]] = True
    return torch.from_numpy(mask).to(device)


def dummy_row(vocab_size: int) -> PackedRow:
    """A 2-token row with one trained token, forwarded by a process without samples."""
    token = vocab_size - 1
    sequence = TrainingSequence([token, token], [0, 1], [0.0, -1.0])
    return pack_row([TrainingSample(sequence, 0.0, 0, -1, -1, -1, "no-samples")])
