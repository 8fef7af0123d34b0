"""GPU check for one H100 (78 GiB) with only torch, transformers and peft (no vLLM, no
``kernels``, no network): the GPU paths of the learner and of the weight stream on a
Qwen3-0.6B-shaped random model, in at most 8 minutes.

Every check is a row of one table; a check that fails, raises or runs past its own time
budget is a failing row. Each check runs in a process of its own (forked from a server that
has imported torch, transformers and the project, so a check starts in about a second, with
a CUDA context of its own): a check past its budget is killed with its process, its GPU memory
and threads with it, before the next one starts. The budgets add up to the total budget
(``--budget-s``, 480 s), and what is left of the total caps each. Exit status 1 when any row
fails.

1. **weights contract**: the learner's exported weights (``learner.export.weight_metadata()``
   and ``iter_weights()``) list the model's own tensors: names, order, shapes, and the
   export dtype (bf16 under bf16 training).
2. **gloo chunk round trip**: those tensors packed into uint8 chunks in the layout of this
   project's ``asyncgrpo_gloo`` engine (:func:`pack`: 16-byte aligned offsets; chunk bounds of
   :func:`asyncgrpo.core.weights.sync.chunk_bounds`), unpacked, loaded into a fresh model:
   every byte and every log-prob equal (bit-equal). Not vLLM's NCCL packer, whose layout
   (unaligned, a chunk closing after the tensor that crosses its limit) needs vLLM, which
   this machine image does not have.
3. **stream race**: a snapshot cloned on the default stream behind a long kernel, read on a
   side stream through :func:`~asyncgrpo.adapters.transfer.streams.stream_ordered` as the
   packer reads it: its bytes equal the weights'. The same read without the ordering is the
   negative control (reported: a control that happened not to race is not a failure).
4. **lora merged**: a LoRA learner's merged export (random non-zero B) loaded into a plain
   model gives the log-probs of the PEFT model that holds its exported adapters (fp32).
5. **dcp resume**: steps A, B, C in one learner against A, save, a fresh learner that loads,
   B, C: the same loss at C (fp32, relative ``DCP_TOL``); a fresh learner that loads nothing
   must miss it (the control).
6. **parity**: per-token log-probs of tree-packed rows against each sample forwarded alone
   (transformers' SDPA), fp32 (TF32 off, ``FP32_TOL``) and bf16 (``BF16_TOL``), per
   tree-attention backend (``flex``, ``torch_varlen`` bf16 only; ``dense`` and ``segments``
   on CPU). **parity control**: the packed row forwarded as one plain causal sequence (samples
   see each other, positions run on) must fail the same tolerance.
7. **grad parity**: gradients of a packed loss against the summed gradients of per-sample
   forwards, fp32, per parameter: the norm of the difference relative to that parameter's
   own gradient norm (at least ``GRAD_NORM_FLOOR`` of the largest), at most ``GRAD_TOL``.
8. **fwd+bwd**: :meth:`Learner.train_step` (FSDP2, bf16 mixed precision, gradient
   checkpointing on) on 2 groups of 8 as one tree-packed and one padding-free row, per
   backend: ms, trained tokens/s, ``perf/fwd_bwd_mfu``, peak memory.
9. **fsdp step**: one train step on a full 16,384-token row (within 1%), gradient
   checkpointing on, and decided by the learner (``gradient_checkpointing=None`` with
   ``token_budget`` the row's length): peak memory, and which way it decided.
10. **tree vs padded**: the same samples (packing ratio about 3.4) as one tree-packed row,
    one padding-free row and one padded batch, fwd+bwd of a bf16 model: ms per step, trained
    tokens/s; on the GPU the tree must be faster than both.
11. **memory**: peak memory of one train step as the row grows (4,096 to 32,768 tokens,
    each row within 1% of its budget), the default backend.
12. **long-row parity**: as 6, on one group whose 8 samples share a 7,680-token prompt (an
    8,200-token row): fp32 (Flex) and bf16 (every backend). Flex's block mask must have fully
    visible blocks (the kernel's path that skips the mask), counted in the row.
13. **recompiles**: Flex forward and backward on full rows of four lengths: the graphs
    torch.compile makes per row (``torch._dynamo``'s counters, what ``TORCH_LOGS=recompiles``
    prints). The block mask builder is compiled once for every length; Flex may recompile
    once, for dynamic shapes, at the second length; none after it.

    python benchmarks/gpu_check.py              # on the GPU machine, at most --budget-s (480)
    python benchmarks/gpu_check.py --dry-run    # CPU: a tiny model, a few tokens (CI runs it)

The dry run checks that every check runs, not the GPU's numbers: the CPU backends, its
learners and the tree-vs-padded model in fp32, one torch thread, no speed criterion, no
stream to race.
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from peft import LoraConfig, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_packing import padding_free_row

from asyncgrpo.adapters.kernels.attention import enable_tree_attention
from asyncgrpo.adapters.kernels.backends import BackendUnavailableError, check_backend
from asyncgrpo.adapters.kernels.layout import tree_block_mask
from asyncgrpo.adapters.kernels.packed_forward import packed_log_probs
from asyncgrpo.adapters.models.lora import wrap_with_lora
from asyncgrpo.adapters.transfer.chunks import pack, padded_nbytes, unpack
from asyncgrpo.adapters.transfer.streams import record_ready, stream_ordered
from asyncgrpo.core.packing.tree import PackedRow, pack_row
from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.core.run.planner import batch_metrics
from asyncgrpo.core.weights.sync import chunk_bounds
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.run.flops import FlopsMeter

FP32_TOL = 1e-3  # max |packed - unpacked| log-prob, nats
BF16_TOL = 0.25  # max, nats; the mean must stay under BF16_TOL / 10
GRAD_TOL = 1e-3  # per parameter: |packed - summed| / |summed| (norms), floored as below
GRAD_NORM_FLOOR = 1e-2  # a parameter's gradient norm counts at least this of the largest
DCP_TOL = 1e-6  # |resumed - uninterrupted| loss at C / |uninterrupted|
ROW_FILL_TOL = 0.01  # a budget-N row holds N tokens within 1%
PACKING_RATIO = (3.2, 3.6)  # the tree-vs-padded samples' packing ratio (aimed at 3.4)
CHEAP_BACKEND = "dense"  # of checks that do not test attention: SDPA, compiled on no device
GPU_BUDGET_S = 480.0  # the whole check on one H100; the dry run's is DRY_RUN_BUDGET_S
DRY_RUN_BUDGET_S = 1200.0
QWEN3_0_6B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151_936,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    max_position_embeddings=40_960,
    rms_norm_eps=1e-6,
)
TINY = dict(
    QWEN3_0_6B,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=256,
    vocab_size=1000,
    max_position_embeddings=4096,
)


@attrs.frozen
class Sizes:
    """Lengths and budgets per mode (GPU, or the CPU dry run).

    Attributes:
        parity: (prompt, completion) tokens of the parity groups (2 groups of 8).
        throughput: (prompt, completion) of the fwd+bwd groups (2 groups of 8).
        full_row: tokens of the fsdp-step row (16,384 on the GPU).
        budgets: tokens of the memory rows.
        long_row: (prompt, completion) of the long-row parity group (one group of 8).
        recompile_rows: tokens of the recompile check's rows, in order.
        tree: (groups, prompt, shortest, longest completion) of the tree-vs-padded samples
            (2 groups on the GPU: the padded batch's activations take about 40 GiB).
        chunk_bytes: bytes per chunk of the weight round trip.
        sleep_cycles: GPU clock cycles of the kernel queued ahead of the race test's snapshot.
        race_numel: float32 elements of each of the race test's 8 tensors.
        repeats: timed steps (median) after one warm-up.
        seconds: per-check time budgets.
    """

    parity: tuple[int, int]
    throughput: tuple[int, int]
    full_row: int
    budgets: tuple[int, ...]
    long_row: tuple[int, int]
    recompile_rows: tuple[int, ...]
    tree: tuple[int, int, int, int]
    chunk_bytes: int
    sleep_cycles: int
    race_numel: int
    repeats: int
    seconds: dict[str, float]

    @classmethod
    def of(cls, dry_run: bool) -> Sizes:
        seconds = {  # on one H100: 480 s in all (GPU_BUDGET_S) with two backends
            "weights": 20,
            "race": 15,
            "lora": 25,
            "dcp": 25,
            "parity": 35,
            "grad": 35,
            "long parity": 40,
            "recompiles": 40,
            "fwd+bwd": 35,
            "fsdp": 35,
            "tree": 30,
            "memory": 40,
        }
        if dry_run:  # generous: a busy CPU in CI must not turn a slow check into a failure
            seconds = dict.fromkeys(seconds, 300.0)
            return cls(
                (12, 6),
                (16, 6),
                256,
                (64, 128),
                (200, 6),
                (64, 96, 128, 160),
                (1, 50, 9, 13),
                4096,
                0,
                1024,
                1,
                seconds,
            )
        return cls(
            (96, 48),
            (1024, 256),
            16_384,
            (4096, 8192, 16_384, 32_768),
            (7680, 64),
            (2048, 3072, 4096, 6144),
            (2, 1024, 196, 294),
            64 * 2**20,
            2_000_000_000,
            2**22,
            3,
            seconds,
        )


# --- samples and rows ----------------------------------------------------------------------


def make_groups(
    vocab: int,
    groups: int,
    prompt: int,
    completion: int,
    rng: np.random.Generator,
    shortest: int | None = None,
    advantage: float | None = None,
) -> list[TrainingSample]:
    """``groups`` x 8 samples; each group shares a random prompt of ``prompt`` tokens;
    completions of ``shortest`` (default ``completion // 2``) to ``completion`` tokens, all
    trained, sampler log-prob ``-log(vocab)``; advantages alternate +-1 unless ``advantage``."""
    low = max(1, completion // 2) if shortest is None else shortest
    lengths = rng.integers(low, completion + 1, (groups, 8))
    return [
        sample
        for group in range(groups)
        for sample in group_of(vocab, group, prompt, lengths[group], rng, advantage)
    ]


def group_of(
    vocab: int,
    group: int,
    prompt: int,
    completions: Sequence[int],
    rng: np.random.Generator,
    advantage: float | None = None,
) -> list[TrainingSample]:
    """One group: a shared random prompt, one sample per completion length."""
    shared = rng.integers(10, vocab, prompt)
    samples = []
    for member, length in enumerate(completions):
        own = rng.integers(10, vocab, int(length))
        tokens = np.concatenate([shared, own])
        mask = np.r_[np.zeros(prompt, np.int8), np.ones(len(own), np.int8)]
        sequence = TrainingSequence(tokens, mask, np.where(mask == 1, -math.log(vocab), 0.0))
        value = (-1.0) ** member if advantage is None else advantage
        samples.append(TrainingSample(sequence, value, 0, group, group, group, f"{group}-{member}"))
    return samples


def full_row(vocab: int, budget: int, rng: np.random.Generator) -> PackedRow:
    """A tree-packed row of ``budget`` tokens: groups of 8 (a prompt of ``budget // 24``
    tokens, completions of half to one prompt) while they fit, then one last group that takes
    exactly the tokens left. A group of prompt ``P`` and completions ``c`` forwards
    ``P + 7 + sum(c)`` tokens (the last prompt token once per branch: it predicts a different
    token in each; :mod:`asyncgrpo.core.packing.tree`). Completions that happen to start
    with the same token share it, so a row may hold a token or two fewer."""
    prompt = max(2, budget // 24)
    samples: list[TrainingSample] = []
    used = 0
    while True:
        lengths = rng.integers(max(1, prompt // 2), prompt + 1, 8)
        left = budget - used - prompt - 7 - int(lengths.sum())
        if left < 0 or 0 < left < 16:  # the last group needs at least 16 tokens
            break
        samples += group_of(vocab, len(samples) // 8, prompt, lengths, rng)
        used += prompt + 7 + int(lengths.sum())
    left = budget - used
    if left >= 16:  # a prompt of at least 1 token and 8 completions of at least 1
        last_prompt = max(1, left // 9)
        share, extra = divmod(left - last_prompt - 7, 8)
        lengths = np.array([share + (member < extra) for member in range(8)])
        samples += group_of(vocab, len(samples) // 8, last_prompt, lengths, rng)
    return pack_row(samples)


def row_fill(row: PackedRow, budget: int) -> tuple[bool, str]:
    """Whether ``row`` holds ``budget`` tokens within :data:`ROW_FILL_TOL`, and a note."""
    fill = row.num_tokens / budget
    return abs(fill - 1) <= ROW_FILL_TOL, f"{row.num_tokens} of {budget} tokens ({fill:.1%})"


# --- models and log-probs ------------------------------------------------------------------


def model_config(tiny: bool) -> Qwen3Config:
    """Qwen3-0.6B's shape, or a tiny one (the dry run's)."""
    return Qwen3Config(**(TINY if tiny else QWEN3_0_6B))


def random_model(dtype: torch.dtype, device: torch.device, tiny: bool, seed: int = 0) -> Any:
    """A random Qwen3 (0.6B shape, or tiny: :func:`model_config`) built on ``device``, in eval
    mode, attending through SDPA; the same ``seed`` gives the same weights."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(tiny), dtype=dtype)
    model.set_attn_implementation("sdpa")
    return model.eval()


def backends_for(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The tree-attention backends to check on ``device``: the CUDA ones the install offers
    (``torch_varlen`` only in bf16), ``dense`` and ``segments`` on CPU."""
    wanted = ["dense", "segments"] if device.type == "cpu" else ["flex", "torch_varlen"]
    offered = []
    for name in wanted:
        if name == "torch_varlen" and dtype == torch.float32:
            continue
        try:
            check_backend(name, device)
            offered.append(name)
        except BackendUnavailableError as error:
            print(f"skipping backend {name}: {error}", file=sys.stderr)
    return offered


def token_log_probs(
    model: Any, input_ids: Sequence[int], predict: Sequence[int], targets: Sequence[int]
) -> torch.Tensor:
    """float [N]: log-probs of ``targets`` predicted at rows ``predict`` of ``input_ids``
    forwarded as one ordinary causal sequence (positions 0..T-1, the model's own attention)."""
    device = model.device
    ids = torch.tensor(np.asarray(input_ids), device=device)[None]
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
    picked = hidden[torch.tensor(np.asarray(predict), device=device)]
    logits = model.get_output_embeddings()(picked).float()
    want = torch.tensor(np.asarray(targets), device=device)
    return torch.log_softmax(logits, -1).gather(-1, want[:, None])[:, 0]


def sample_log_probs(model: Any, sample: TrainingSample) -> torch.Tensor:
    """float [n]: the log-probs of ``sample``'s trained tokens, the sample forwarded alone."""
    mask = np.asarray(sample.sequence.trained_mask).astype(bool)
    positions = np.flatnonzero(mask)
    ids = np.asarray(sample.sequence.input_ids)
    return token_log_probs(model, ids, positions - 1, ids[positions])


def unpacked_log_probs(model: Any, samples: Sequence[TrainingSample]) -> torch.Tensor:
    """The reference: each sample alone through SDPA, in sample order (``target_ids``'s)."""
    with torch.no_grad():
        return torch.cat([sample_log_probs(model, sample) for sample in samples])


def differs(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    """(within tolerance, a note): fp32 max <= FP32_TOL; bf16 max <= BF16_TOL and mean
    <= BF16_TOL / 10."""
    diff = (got.float() - want.float()).abs()
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    within = diff.max().item() <= tol and (dtype == torch.float32 or diff.mean().item() <= tol / 10)
    return within, f"max {diff.max().item():.2e}, mean {diff.mean().item():.2e} (tol {tol:g})"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- the checks ----------------------------------------------------------------------------

Row = dict[str, Any]


def row(
    check: str, dtype: str, backend: str, tokens: int | str, result: str, ok: bool, **figures: Any
) -> Row:
    return {
        "check": check,
        "dtype": dtype,
        "backend": backend,
        "tokens": tokens,
        "result": result,
        "ok": ok,
        **figures,
    }


def learner_config(device: torch.device, **overrides: Any) -> AsyncGRPOConfig:
    """The learners' settings: bf16 mixed precision on CUDA (fp32 on a CPU, where bf16
    attention is slow and proves nothing about the GPU), checkpointing on."""
    settings = dict(
        output_dir=tempfile.gettempdir() + "/gpu_check",
        bf16=device.type == "cuda",
        score_centering=False,
        vllm_importance_sampling_clip_max=1e9,
        learning_rate=1e-7,
        use_cpu=device.type == "cpu",
        gradient_checkpointing=True,
    )
    return AsyncGRPOConfig(**{**settings, **overrides})


def precision(device: torch.device) -> str:
    """The learners' precision (:func:`learner_config`) as the table writes it."""
    return "bf16" if device.type == "cuda" else "float32"


def check_weights(device: torch.device, sizes: Sizes, dry_run: bool) -> list[Row]:
    """Rows 1 and 2: the export's contract, then the packed round trip (module docstring)."""
    reference = random_model(torch.bfloat16, device, dry_run)
    expected = [
        (name, torch.bfloat16, tuple(t.shape)) for name, t in reference.state_dict().items()
    ]
    del reference
    model = random_model(torch.float32, device, dry_run).train()
    settings = learner_config(device, bf16=True)
    with Learner(model, settings, attention_backend=CHEAP_BACKEND) as learner:
        declared = learner.export.weight_metadata()
        weights = [
            (name, tensor.detach().clone()) for name, tensor in learner.export.iter_weights()
        ]
    yielded = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in weights]
    total = sum(t.numel() * t.element_size() for _, t in weights)
    problems = [
        what
        for what, same in (
            ("metadata", declared == expected),
            ("iter_weights", yielded == expected),
        )
        if not same
    ]
    contract = row(
        "weights contract",
        "bf16",
        "-",
        "-",
        f"{len(weights)} tensors, {total / 2**20:.1f} MiB; names, order, shapes and "
        f"dtypes {'differ in ' + ', '.join(problems) if problems else 'as the model'}",
        not problems,
    )
    metas = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in weights]
    sizes_b = [padded_nbytes(dtype, shape) for _, dtype, shape in metas]
    received: list[tuple[str, torch.Tensor]] = []
    bounds = chunk_bounds(sizes_b, sizes.chunk_bytes)
    for start, stop in bounds:
        chunk = pack([t for _, t in weights[start:stop]], sizes_b[start:stop])
        received += unpack(chunk.cpu().clone(), metas[start:stop])  # as if over the wire
    same_bytes = all(
        torch.equal(a.cpu(), b) for (_, a), (_, b) in zip(weights, received, strict=True)
    )
    direct = random_model(torch.bfloat16, device, dry_run, seed=1)
    direct.load_state_dict(dict(weights))
    streamed = random_model(torch.bfloat16, device, dry_run, seed=2)
    streamed.load_state_dict({name: t.to(device) for name, t in received})
    samples = make_groups(direct.config.vocab_size, 1, *sizes.parity, np.random.default_rng(3))
    equal_logp = torch.equal(
        unpacked_log_probs(direct, samples), unpacked_log_probs(streamed, samples)
    )
    trip = row(
        "gloo chunk round trip",
        "bf16",
        "-",
        "-",
        f"{len(bounds)} chunks; bytes {'equal' if same_bytes else 'DIFFER'}, log-probs "
        f"{'bit-equal' if equal_logp else 'DIFFER'}",
        same_bytes and equal_logp,
    )
    return [contract, trip]


def check_race(device: torch.device, sizes: Sizes) -> list[Row]:
    """Row 3: the snapshot read on a side stream with and without stream ordering."""
    torch.manual_seed(4)
    weights = [(f"w{i}", torch.randn(sizes.race_numel, device=device)) for i in range(8)]
    ordered, expected = race_read(device, weights, sizes.sleep_cycles, ordered=True)
    ok = torch.equal(ordered, expected)
    control, expected = race_read(device, weights, sizes.sleep_cycles, ordered=False)
    raced = not torch.equal(control, expected)
    where = (
        "a CPU has no streams to race"
        if device.type == "cpu"
        else ("raced (stale bytes read)" if raced else "did not race this time")
    )
    mib = 8 * sizes.race_numel * 4 / 2**20
    return [
        row(
            "stream race",
            "float32",
            "-",
            "-",
            f"{mib:.0f} MiB read behind {sizes.sleep_cycles:,} cycles: bytes "
            f"{'as written' if ok else 'STALE'}; control without stream_ordered: {where}",
            ok,
        )
    ]


def race_read(
    device: torch.device, weights: list[tuple[str, torch.Tensor]], cycles: int, ordered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queue a long kernel and an in-place write (+1) on the default stream, clone the
    snapshot there and record ``ready``; read the snapshot's bytes on a side stream as the
    packer does, through ``stream_ordered`` or (the control) not. Returns (what the side
    stream read, the weights' bytes once everything finished)."""
    synchronize(device)
    if device.type == "cuda" and cycles:
        torch.cuda._sleep(cycles)
    with torch.no_grad():
        for _, tensor in weights:
            tensor.add_(1)
        snapshot = [(name, tensor.clone()) for name, tensor in weights]
    ready = record_ready(device)
    pairs: Iterable[tuple[str, torch.Tensor]] = (
        stream_ordered(snapshot, ready) if ordered else iter(snapshot)
    )
    with side_stream(device):
        read = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in pairs])
    synchronize(device)
    expected = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in weights])
    return read, expected


def side_stream(device: torch.device) -> AbstractContextManager[Any]:
    """A fresh CUDA stream made current (as a sender's packing stream); nothing on a CPU."""
    return torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_lora(device: torch.device, sizes: Sizes, dry_run: bool) -> list[Row]:
    """Row 4: the learner's merged LoRA export against the PEFT forward of its adapters."""
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    model = random_model(torch.float32, device, dry_run).train()
    config = learner_config(device, bf16=False)
    with Learner(model, config, peft_config=lora, attention_backend=CHEAP_BACKEND) as learner:
        merged = learner.export.full_state_dict()
        adapters = learner.export.adapter_state_dict()
    nonzero = all(t.abs().max().item() > 0 for k, t in adapters.items() if "lora_B" in k)
    adapted = wrap_with_lora(random_model(torch.float32, device, dry_run), lora)
    set_peft_model_state_dict(adapted, adapters)
    plain = random_model(torch.float32, device, dry_run, seed=1)
    plain.load_state_dict(merged)
    samples = make_groups(plain.config.vocab_size, 1, *sizes.parity, np.random.default_rng(5))
    want = unpacked_log_probs(adapted.eval(), samples)
    base = unpacked_log_probs(random_model(torch.float32, device, dry_run), samples)
    within, note = differs(unpacked_log_probs(plain, samples), want, torch.float32)
    moved, _ = differs(base, want, torch.float32)
    return [
        row(
            "lora merged",
            "float32",
            "-",
            len(want),
            f"merged vs adapter forward: {note}; B non-zero: {nonzero}; adapters move the "
            f"log-probs: {not moved}",
            within and nonzero and not moved,
        )
    ]


def check_dcp(device: torch.device, sizes: Sizes) -> list[Row]:
    """Row 5: a save and a resume through torch.distributed.checkpoint, against no break, on
    the tiny model on every device (what it checks is the resume, not the size: a 0.6B
    model's checkpoint with AdamW's moments would take 7 GiB and most of the budget)."""
    vocab = model_config(tiny=True).vocab_size
    rng = np.random.default_rng(6)
    a, b, c = (pack_row(make_groups(vocab, 1, *sizes.parity, rng, advantage=1.0)) for _ in range(3))
    config = learner_config(device, bf16=False, learning_rate=1e-4)
    backend = CHEAP_BACKEND
    where = tempfile.mkdtemp(prefix="gpu_check_dcp_")
    try:
        model = random_model(torch.float32, device, tiny=True).train()
        with Learner(model, config, attention_backend=backend) as learner:
            learner.train_step([a])
            learner.save_checkpoint(where)
            learner.train_step([b])
            straight = learner.train_step([c]).metrics["loss"]
        losses = []
        for load in (True, False):  # the resume, then the control
            model = random_model(torch.float32, device, tiny=True, seed=7).train()
            with Learner(model, config, attention_backend=backend) as learner:
                if load:
                    learner.load_checkpoint(where)
                learner.train_step([b])
                losses.append(learner.train_step([c]).metrics["loss"])
            free_memory()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    resumed, control = (abs(loss - straight) / max(abs(straight), 1e-12) for loss in losses)
    return [
        row(
            "dcp resume",
            "float32",
            backend,
            c.num_tokens,
            f"loss at C {straight:.6g}: resumed off by {resumed:.1e} (tol {DCP_TOL:g}), "
            f"unloaded control off by {control:.1e}",
            resumed <= DCP_TOL and control > DCP_TOL,
        )
    ]


def check_parity(
    device: torch.device,
    sizes: Sizes,
    dry_run: bool,
    dtype: torch.dtype,
) -> list[Row]:
    """Row 6 in ``dtype``: every backend, and the plain-causal control."""
    model = random_model(dtype, device, dry_run)
    samples = make_groups(model.config.vocab_size, 2, *sizes.parity, np.random.default_rng(1))
    want = unpacked_log_probs(model, samples)
    packed = pack_row(samples)
    name = str(dtype).removeprefix("torch.")
    with torch.no_grad():
        control = token_log_probs(model, packed.input_ids, packed.predict_index, packed.target_ids)
    within, note = differs(control, want, dtype)
    rows = [
        row(
            "parity control",
            name,
            "causal",
            packed.num_tokens,
            f"plain causal mask over the packed row: {note}; must exceed",
            not within,
        )
    ]
    enable_tree_attention(model)
    for backend in backends_for(device, dtype):
        with torch.no_grad():
            got = packed_log_probs(model, packed, 1.0, backend=backend).logp
        within, note = differs(got, want, dtype)
        rows.append(row("parity", name, backend, packed.num_tokens, note, within))
    return rows


def check_gradients(device: torch.device, sizes: Sizes, dry_run: bool) -> list[Row]:
    """Row 7: packed gradients against summed per-sample gradients, fp32, every backend."""
    model = random_model(torch.float32, device, dry_run)
    samples = make_groups(model.config.vocab_size, 2, *sizes.parity, np.random.default_rng(8))
    packed = pack_row(samples)
    weights = torch.randn(len(packed.target_ids), generator=torch.Generator().manual_seed(9))
    weights = weights.to(device)
    index = torch.as_tensor(packed.sample_index, device=device)
    for i, sample in enumerate(samples):
        (weights[index == i] * sample_log_probs(model, sample)).sum().backward()
    want = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    # each parameter against its own gradient's norm, so that an error in a small gradient
    # (an attention projection's) does not hide under the largest; the norm counts at least
    # GRAD_NORM_FLOOR of the largest (a gradient that small is a sum that mostly cancels)
    largest = max(g.norm().item() for g in want.values())
    enable_tree_attention(model)
    rows = []
    for backend in backends_for(device, torch.float32):
        model.zero_grad(set_to_none=True)
        (weights * packed_log_probs(model, packed, 1.0, backend=backend).logp).sum().backward()
        relative = {
            name: (p.grad - want[name]).norm().item()
            / max(want[name].norm().item(), GRAD_NORM_FLOOR * largest)
            for name, p in model.named_parameters()
        }
        worst = max(relative, key=relative.__getitem__)
        rows.append(
            row(
                "grad parity",
                "float32",
                backend,
                packed.num_tokens,
                f"largest difference {relative[worst]:.2e} of its own gradient's norm, "
                f"in {worst} (tol {GRAD_TOL:g} per parameter)",
                relative[worst] <= GRAD_TOL,
            )
        )
    return rows


def step_figures(
    learner: Learner, packed: PackedRow, meter: FlopsMeter, repeats: int, device: torch.device
) -> dict[str, Any]:
    """Median train step over ``repeats`` after one warm-up; peak memory of the timed steps;
    whether every loss was finite."""
    losses = [learner.train_step([packed]).metrics["loss"]]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = [learner.train_step([packed]).metrics for _ in range(repeats)]
    losses += [m["loss"] for m in steps]
    seconds = statistics.median(m["perf/fwd_bwd_s"] for m in steps)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        "ms": 1e3 * seconds,
        "tok_s": len(packed.target_ids) / seconds,
        "mfu": meter.of_rows([packed]) / (seconds * meter.peak_flops),
        "peak_gib": peak,
        "finite": all(math.isfinite(loss) for loss in losses),
    }


def check_steps(device: torch.device, sizes: Sizes, dry_run: bool, backend: str) -> list[Row]:
    """Row 8 for ``backend``: the learner on one tree-packed and one padding-free row."""
    config = model_config(dry_run)
    meter = FlopsMeter(config, device, bf16=device.type == "cuda")
    samples = make_groups(config.vocab_size, 2, *sizes.throughput, np.random.default_rng(2))
    layouts = {"tree": pack_row(samples), "padding-free": padding_free_row(samples)}
    rows = []
    model = random_model(torch.float32, device, dry_run).train()  # FSDP2 shards it in place
    with Learner(model, learner_config(device), attention_backend=backend) as learner:
        for name, packed in layouts.items():
            figures = step_figures(learner, packed, meter, sizes.repeats, device)
            rows.append(
                row(
                    f"fwd+bwd {name}",
                    precision(device),
                    backend,
                    packed.num_tokens,
                    f"{len(packed.target_ids)} trained, checkpointing on",
                    figures.pop("finite"),
                    **figures,
                )
            )
    return rows


def check_full_row(
    device: torch.device,
    sizes: Sizes,
    dry_run: bool,
    checkpointing: bool | None,
) -> list[Row]:
    """Row 9: one step on a full row, checkpointing on or decided, the default backend."""
    config = model_config(dry_run)
    meter = FlopsMeter(config, device, bf16=device.type == "cuda")
    packed = full_row(config.vocab_size, sizes.full_row, np.random.default_rng(10))
    full, fill = row_fill(packed, sizes.full_row)
    model = random_model(torch.float32, device, dry_run).train()
    settings = learner_config(
        device, gradient_checkpointing=checkpointing, token_budget=sizes.full_row
    )
    with Learner(model, settings) as learner:
        enabled = learner.model.is_gradient_checkpointing
        backend = learner.attention.name
        figures = step_figures(learner, packed, meter, 1, device)
    mode = "on" if checkpointing else "decided"
    return [
        row(
            f"fsdp step checkpointing {mode}",
            precision(device),
            backend,
            packed.num_tokens,
            f"{fill}; checkpointing {'on' if enabled else 'off'}",
            full and figures.pop("finite") and (enabled or checkpointing is None),
            **figures,
        )
    ]


def check_tree_vs_padded(device: torch.device, sizes: Sizes, dry_run: bool) -> list[Row]:
    """Row 10: fwd+bwd of the same samples as a tree-packed row, a padding-free row and a
    right-padded batch through a bf16 model (no FSDP, no checkpointing; fp32 on a CPU, whose
    bf16 matrix products may be slower)."""
    groups, prompt, shortest, longest = sizes.tree
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(dtype, device, dry_run).train()
    vocab = model.config.vocab_size
    samples = make_groups(vocab, groups, prompt, longest, np.random.default_rng(11), shortest)
    tree, free = pack_row(samples), padding_free_row(samples)
    ratio = batch_metrics([[tree]], tree.num_tokens)["batch/packing_ratio"]
    backend = "flex" if device.type == "cuda" else "segments"
    steps: dict[str, Callable[[], torch.Tensor]] = {
        "tree": lambda: packed_step(model, tree, backend),
        "padding-free": lambda: packed_step(model, free, backend),
        "padded": lambda: padded_step(model, samples),
    }
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for repeat in range(sizes.repeats + 1):  # alternating, the first round a warm-up
        for name, step in steps.items():
            synchronize(device)
            start = time.perf_counter()
            step().backward()
            synchronize(device)
            if repeat:
                seconds[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    trained = len(tree.target_ids)
    forwarded = {
        "tree": tree.num_tokens,
        "padding-free": free.num_tokens,
        "padded": len(samples) * max(len(s.sequence) for s in samples),
    }
    in_range = PACKING_RATIO[0] <= ratio <= PACKING_RATIO[1]
    rows = []
    for name in steps:
        speedup = median[name] / median["tree"]
        faster = name == "tree" or dry_run or speedup > 1.0
        rows.append(
            row(
                f"tree vs padded: {name}",
                str(dtype).removeprefix("torch."),
                backend if name != "padded" else "sdpa",
                forwarded[name],
                f"packing ratio {ratio:.2f}; tree's speedup {speedup:.2f}x"
                if name != "tree"
                else f"packing ratio {ratio:.2f} (aimed at 3.4; {trained} trained)",
                in_range and faster,
                ms=1e3 * median[name],
                tok_s=trained / median[name],
            )
        )
    return rows


def packed_step(model: Any, packed: PackedRow, backend: str) -> torch.Tensor:
    """The loss of one packed row (log-probs times advantages, mean), tree attention."""
    enable_tree_attention(model)
    logp = packed_log_probs(model, packed, 1.0, backend=backend).logp
    return -(logp * torch.as_tensor(packed.advantages, device=logp.device)).mean()


def padded_step(model: Any, samples: Sequence[TrainingSample]) -> torch.Tensor:
    """The same loss over a right-padded batch [B, L] through SDPA; the LM head only at the
    trained positions, as the packed forward does."""
    model.set_attn_implementation("sdpa")
    device, longest = model.device, max(len(s.sequence) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    attention = torch.zeros(len(samples), longest, dtype=torch.long)
    picks, targets, advantages = [], [], []
    for i, sample in enumerate(samples):
        tokens = torch.tensor(np.asarray(sample.sequence.input_ids))
        ids[i, : len(tokens)], attention[i, : len(tokens)] = tokens, 1
        positions = np.flatnonzero(np.asarray(sample.sequence.trained_mask))
        picks += [i * longest + p - 1 for p in positions]
        targets += tokens[positions].tolist()
        advantages += [sample.advantage] * len(positions)
    hidden = model.get_decoder()(
        input_ids=ids.to(device), attention_mask=attention.to(device), use_cache=False
    ).last_hidden_state
    picked = hidden.reshape(-1, hidden.shape[-1])[torch.as_tensor(picks, device=device)]
    logits = model.get_output_embeddings()(picked).float()
    want = torch.as_tensor(targets, device=device)
    logp = torch.log_softmax(logits, -1).gather(-1, want[:, None])[:, 0]
    return -(logp * torch.as_tensor(advantages, device=device)).mean()


def check_memory(device: torch.device, sizes: Sizes, dry_run: bool) -> list[Row]:
    """Row 11: peak memory of a step as the (full) row grows, the learner's default backend."""
    config = model_config(dry_run)
    meter = FlopsMeter(config, device, bf16=device.type == "cuda")
    rng = np.random.default_rng(12)
    rows = []
    model = random_model(torch.float32, device, dry_run).train()
    with Learner(model, learner_config(device)) as learner:
        for budget in sizes.budgets:
            packed = full_row(config.vocab_size, budget, rng)
            full, fill = row_fill(packed, budget)
            figures = step_figures(learner, packed, meter, 1, device)
            rows.append(
                row(
                    f"memory budget {budget}",
                    precision(device),
                    learner.attention.name,
                    packed.num_tokens,
                    f"{fill}, checkpointing on",
                    full and figures.pop("finite"),
                    **figures,
                )
            )
    return rows


def check_long_parity(device: torch.device, sizes: Sizes, dry_run: bool) -> list[Row]:
    """Row 12: a long row's log-probs against each sample alone: fp32 through the backends
    that run it, bf16 through all; Flex's block mask must hold fully visible blocks."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model(dtype, device, dry_run)
        rng = np.random.default_rng(13)
        samples = make_groups(model.config.vocab_size, 1, *sizes.long_row, rng)
        want = unpacked_log_probs(model, samples)
        packed = pack_row(samples)
        enable_tree_attention(model)
        name = str(dtype).removeprefix("torch.")
        for backend in backends_for(device, dtype):
            with torch.no_grad():
                got = packed_log_probs(model, packed, 1.0, backend=backend).logp
            within, note = differs(got, want, dtype)
            if backend == "flex":
                full = int(tree_block_mask(packed, device).full_kv_num_blocks.sum())
                note += f"; {full} fully visible blocks"
                within = within and full > 0
            rows.append(row("long-row parity", name, backend, packed.num_tokens, note, within))
        del model
        free_memory()
    return rows


def check_recompiles(device: torch.device, sizes: Sizes, dry_run: bool) -> list[Row]:
    """Row 13: the graphs torch.compile makes per row as the row's length changes (Flex on a
    GPU; none on the CPU backends): at most one recompile, at the second length."""
    from torch._dynamo.utils import counters

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(dtype, device, dry_run).train()
    backend = "flex" if device.type == "cuda" else "segments"
    rng = np.random.default_rng(14)
    graphs = []
    for tokens in sizes.recompile_rows:
        packed = full_row(model.config.vocab_size, tokens, rng)
        before = counters["stats"]["unique_graphs"]
        packed_step(model, packed, backend).backward()
        model.zero_grad(set_to_none=True)
        graphs.append(counters["stats"]["unique_graphs"] - before)
    later = sum(graphs[2:])
    return [
        row(
            "recompiles",
            str(dtype).removeprefix("torch."),
            backend,
            "/".join(str(t) for t in sizes.recompile_rows),
            f"graphs compiled per row {graphs}; {later} after the second length",
            later == 0,
        )
    ]


# --- running them --------------------------------------------------------------------------


@attrs.frozen
class Check:
    """One unit of the table: its label (for a row when it cannot give its own), its budget
    in seconds, and the body that returns its rows."""

    check: str
    dtype: str
    backend: str
    budget_s: float
    body: Callable[[], list[Row]]


def checks(device: torch.device, sizes: Sizes, dry_run: bool) -> list[Check]:
    """Every check, cheapest and most telling first (the total budget may end the run before
    the last ones)."""
    s = sizes.seconds
    units = [
        Check("weights", "bf16", "-", s["weights"], partial(check_weights, device, sizes, dry_run)),
        Check("stream race", "float32", "-", s["race"], partial(check_race, device, sizes)),
        Check(
            "lora merged", "float32", "-", s["lora"], partial(check_lora, device, sizes, dry_run)
        ),
        Check("dcp resume", "float32", "dense", s["dcp"], partial(check_dcp, device, sizes)),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        body = partial(check_parity, device, sizes, dry_run, dtype)
        units.append(Check("parity", name, "all", s["parity"], body))
    grad = partial(check_gradients, device, sizes, dry_run)
    units.append(Check("grad parity", "float32", "all", s["grad"], grad))
    long_rows = partial(check_long_parity, device, sizes, dry_run)
    units.append(Check("long-row parity", "both", "all", s["long parity"], long_rows))
    recompiles = partial(check_recompiles, device, sizes, dry_run)
    units.append(Check("recompiles", precision(device), "flex", s["recompiles"], recompiles))
    for backend in backends_for(device, torch.bfloat16):
        body = partial(check_steps, device, sizes, dry_run, backend)
        units.append(Check("fwd+bwd", precision(device), backend, s["fwd+bwd"], body))
    for mode in (True, None):
        body = partial(check_full_row, device, sizes, dry_run, mode)
        label = f"fsdp step checkpointing {'on' if mode else 'decided'}"
        units.append(Check(label, precision(device), "default", s["fsdp"], body))
    tree = partial(check_tree_vs_padded, device, sizes, dry_run)
    units.append(Check("tree vs padded", precision(device), "-", s["tree"], tree))
    memory = partial(check_memory, device, sizes, dry_run)
    units.append(Check("memory", precision(device), "default", s["memory"], memory))
    return units


def print_plan(units: Sequence[Check], budget_s: float) -> float:
    """Print the planned time of each check (its budget, and when it would end if every check
    before it used its whole budget) against the total ``budget_s``; return the planned sum.
    A check planned to end past the total runs only if those before it finish early."""
    print(f"plan: {len(units)} checks in at most {budget_s:.0f} s")
    print("| check | dtype | backend | budget s | ends by s | within the total |")
    print("|---|---|---|---|---|---|")
    ends = 0.0
    for unit in units:
        ends += unit.budget_s
        within = "yes" if ends <= budget_s else "only if earlier checks finish early"
        print(
            f"| {unit.check} | {unit.dtype} | {unit.backend} | {unit.budget_s:.0f} "
            f"| {ends:.0f} | {within} |"
        )
    print(f"planned: {ends:.0f} s of budgets against {budget_s:.0f} s in all", flush=True)
    return ends


def run_all(units: Sequence[Check], budget_s: float, dry_run: bool) -> list[Row]:
    """Run ``units`` one after another, each in a process of its own waited for at most its
    own budget (and what is left of ``budget_s``): a unit that raises is a failing row with
    its error, one whose process dies a failing row with its exit code, and one that overruns
    is killed, its process with its GPU memory and threads, before the next one starts."""
    context = multiprocessing.get_context("forkserver")
    # the server imports these once; each check's process forks from it
    context.set_forkserver_preload(["torch", "transformers", "peft", "asyncgrpo.shell.learner"])
    deadline = time.monotonic() + budget_s
    rows: list[Row] = []
    for unit in units:
        left = deadline - time.monotonic()
        if left < 1:
            note = f"not run: the total budget of {budget_s:.0f} s is spent"
            rows.append(row(unit.check, unit.dtype, unit.backend, "-", note, False))
            continue
        limit = min(unit.budget_s, left)
        start = time.perf_counter()
        outcome = run_in_process(context, unit.body, limit, dry_run)
        elapsed = time.perf_counter() - start
        label = f"{unit.check} {unit.dtype} {unit.backend}"
        print(f"done {label} in {elapsed:.1f} s", file=sys.stderr, flush=True)
        if isinstance(outcome, str):
            rows.append(row(unit.check, unit.dtype, unit.backend, "-", outcome, False))
            continue
        for r in outcome:
            r["s"] = elapsed
            rows.append(r)
    return rows


def run_in_process(
    context: Any, body: Callable[[], list[Row]], limit: float, dry_run: bool
) -> list[Row] | str:
    """``body``'s rows, run in a new process of ``context``; or why there are none (its error,
    its death, or its overrun: then the process is killed)."""
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=run_check, args=(body, send, dry_run), daemon=True)
    process.start()
    send.close()  # the child's end: an EOF here when the child dies without a reply
    try:
        if not receive.poll(limit):
            process.kill()
            return f"timeout: killed after {limit:.0f} s"
        outcome = receive.recv()
    except EOFError:
        process.join(10)
        return f"error: the check's process died (exit code {process.exitcode})"
    finally:
        process.join(30)
        if process.is_alive():  # stuck in its teardown (a CUDA context): the rows are in
            process.kill()
            process.join()
        receive.close()
    return outcome


def run_check(body: Callable[[], list[Row]], send: Connection, dry_run: bool) -> None:
    """A check's process: the settings of the run, then its rows, or its error, sent back."""
    configure(dry_run)
    try:
        outcome: list[Row] | str = body()
    except Exception as error:
        traceback.print_exc(file=sys.stderr)
        outcome = f"error: {type(error).__name__}: {str(error)[:160]}"
    send.send(outcome)
    send.close()


def configure(dry_run: bool) -> None:
    """Per process: TF32 off on a GPU (fp32 parity means fp32), one thread on the CPU (tiny
    operations: threads only spin, more so on a busy CPU)."""
    if torch.cuda.is_available() and not dry_run:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if dry_run:
        torch.set_num_threads(1)


def print_table(rows: list[Row], device: torch.device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}")
    print(
        "| check | dtype | backend | tokens | result | ms | trained tok/s | MFU | peak GiB "
        "| s | ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def fmt(value: Any, spec: str) -> str:
        return "" if value is None else format(value, spec)

    for r in rows:
        print(
            f"| {r['check']} | {r['dtype']} | {r['backend']} | {r['tokens']} | {r['result']} "
            f"| {fmt(r.get('ms'), '.1f')} | {fmt(r.get('tok_s'), ',.0f')} "
            f"| {fmt(r.get('mfu'), '.3f')} | {fmt(r.get('peak_gib'), '.2f')} "
            f"| {fmt(r.get('s'), '.0f')} | {'yes' if r['ok'] else 'NO'} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny model, few tokens, CPU backends only"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds for all checks together (default {GPU_BUDGET_S:.0f}; "
        f"{DRY_RUN_BUDGET_S:.0f} with --dry-run)",
    )
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    sizes = Sizes.of(args.dry_run)
    configure(args.dry_run)
    budget_s = args.budget_s or (DRY_RUN_BUDGET_S if args.dry_run else GPU_BUDGET_S)
    units = checks(device, sizes, args.dry_run)
    print_plan(units, budget_s)
    rows = run_all(units, budget_s, args.dry_run)
    print_table(rows, device)
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
