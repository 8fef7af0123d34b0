"""Tree attention: the backends agree with the dense reference, the flex mask predicate equals
the row's dense mask, and misuse fails with errors that name the fix."""

import importlib.util

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from packing_strategies import make_sample, sample_sets
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from asyncgrpo.adapters.kernels import backends
from asyncgrpo.adapters.kernels.attention import (
    TREE_ATTENTION,
    enable_tree_attention,
    tree_attention_forward,
    tree_layout,
)
from asyncgrpo.adapters.kernels.backends import (
    ATTENTION_MEMORY,
    BackendUnavailableError,
    check_backend,
    choose_backend,
)
from asyncgrpo.adapters.kernels.layout import BACKENDS, compiled_block_mask, tree_mask_mod
from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.core.packing.attention_choice import cheaper_backend
from asyncgrpo.core.packing.flops import query_key_pairs
from asyncgrpo.core.packing.memory import LINEAR, QUADRATIC
from asyncgrpo.core.packing.tree import pack_row

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16

ROW = pack_row(
    [
        make_sample([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]),
        make_sample([1, 2, 3, 7, 8, 9], [0, 0, 0, 1, 1, 1]),
        make_sample([1, 2, 3, 7, 8], [0, 0, 0, 1, 1]),
        make_sample([5, 6, 6], [0, 1, 1]),
    ]
)


def attend(row, backend, query, key, value):
    layout = tree_layout(row, "cpu", backend)
    out, weights = tree_attention_forward(
        torch.nn.Identity(), query, key, value, None, scaling=0.3, tree_layout=layout
    )
    assert weights is None
    return out


@settings(max_examples=40)
@given(samples=sample_sets(max_len=8), seed=st.integers(0, 2**16))
def test_segments_equal_dense_outputs_and_gradients_on_random_trees(samples, seed) -> None:
    row = pack_row(samples)
    t = row.num_tokens
    generator = torch.Generator().manual_seed(seed)
    shapes = [(1, HEADS, t, HEAD_DIM), (1, KV_HEADS, t, HEAD_DIM), (1, KV_HEADS, t, HEAD_DIM)]
    inputs = [torch.randn(s, generator=generator) for s in shapes]
    upstream = torch.randn(1, t, HEADS, HEAD_DIM, generator=generator)
    results = {}
    for backend in ("dense", "segments"):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = attend(row, backend, *leaves)
        (out * upstream).sum().backward()
        results[backend] = [out, *(leaf.grad for leaf in leaves)]
    assert results["segments"][0].shape == (1, t, HEADS, HEAD_DIM)
    for got, want in zip(results["segments"], results["dense"], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@settings(max_examples=60)
@given(samples=sample_sets())
def test_flex_mask_predicate_equals_the_dense_mask(samples) -> None:
    row = pack_row(samples)
    index = torch.arange(row.num_tokens)
    zero = torch.zeros((), dtype=torch.long)
    grid = tree_mask_mod(row, "cpu")(zero, zero, index[:, None], index[None, :])
    assert torch.equal(grid, torch.from_numpy(row.dense_mask()))


@pytest.mark.slow("compiles create_block_mask with inductor on the CPU, 15-45 s")
def test_block_masks_are_compiled_once_for_every_row_length_and_tree() -> None:
    """Flex's block masks on a GPU come from the compiled builder, block by block: on the CPU
    here, equal to what the eager builder makes from the whole T x T mask, for rows of three
    lengths and trees, with one graph compiled for the first and none for the others."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask

    graphs = []
    for samples, prompt in ((2, 150), (3, 260), (5, 410)):
        shared = list(range(3, 3 + prompt))
        row = pack_row(
            [
                make_sample(shared + [7 + i] * (100 + 37 * i), [0] * prompt + [1] * (100 + 37 * i))
                for i in range(samples)
            ]
        )
        t = row.num_tokens
        mask_mod = tree_mask_mod(row, "cpu")
        built = compiled_block_mask(mask_mod, None, None, t, t, "cpu")
        eager = create_block_mask(mask_mod, None, None, t, t, device="cpu")
        for part in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(built, part), getattr(eager, part)), (t, part)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs[1] == graphs[2] == graphs[0]


def test_cpu_default_is_chosen_per_row_by_cost_and_no_transformers_mask_is_built() -> None:
    assert choose_backend("cpu").for_row(None) == "segments"
    many_short = pack_row([make_sample([i, i + 1, i + 2], [0, 1, 1]) for i in range(0, 600, 3)])
    one_long = pack_row([make_sample(list(range(2000)), [0] + [1] * 1999)])
    for row in (ROW, many_short, one_long):
        pairs = query_key_pairs(row.cu_seqlens_q, row.cu_seqlens_k)
        assert tree_layout(row, "cpu").backend == cheaper_backend(
            row.num_tokens, row.num_segments, pairs, 128, 2
        )
    assert tree_layout(many_short, "cpu").backend == "dense"
    assert tree_layout(one_long, "cpu").backend == "segments"
    assert TREE_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("backend", ["flash_varlen", "flex", "torch_varlen"])
def test_gpu_backend_on_a_machine_without_cuda_names_what_is_missing(backend) -> None:
    with pytest.raises(BackendUnavailableError, match=f"'{backend}' needs a CUDA device"):
        tree_layout(ROW, "cpu", backend)
    if backend == "flash_varlen":
        with pytest.raises(BackendUnavailableError, match=r"pip install asyncgrpo\[gpu\]"):
            check_backend(backend, "cpu")


def test_every_backend_declares_what_its_attention_keeps() -> None:
    """SDPA keeps the weights (T x T); the varlen kernels and Flex recompute them (T)."""
    assert set(ATTENTION_MEMORY) == set(BACKENDS)
    assert {b for b, kind in ATTENTION_MEMORY.items() if kind == QUADRATIC} == {"dense", "segments"}
    assert {b for b, kind in ATTENTION_MEMORY.items() if kind == LINEAR} == {
        "flash_varlen",
        "flex",
        "torch_varlen",
    }
    assert choose_backend("cpu").memory == QUADRATIC  # dense or segments, row by row
    assert choose_backend("cpu", "segments").memory == QUADRATIC


@pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("kernels") is not None,
    reason="needs a machine without CUDA and without `kernels`, where the flash probe fails",
)
def test_a_failed_flash_probe_is_kept_with_its_cause_and_never_retried(monkeypatch) -> None:
    """``kernels`` missing (or the hub unreachable): the probe runs once per device, the run
    falls back to ``"flex"`` naming why, and every later forward gets the kept error."""
    monkeypatch.setattr(backends, "_FLASH_KERNELS", {}, raising=False)  # a fresh process's
    probes = []
    real_find_spec = importlib.util.find_spec

    def counting_find_spec(name, *args, **kwargs):  # the real probe's first step, counted
        probes.extend([name] if name == "kernels" else [])
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", counting_find_spec)
    choice = choose_backend("cuda")  # the run's choice on a GPU machine without `kernels`
    assert (choice.backend, choice.memory) == ("flex", LINEAR)
    assert "the `kernels` package" in choice.reason
    for _ in range(5):  # every row's default, on a device without the run's choice at hand
        assert choose_backend("cuda").for_row(ROW) == "flex"
    assert choice.for_row(ROW) == "flex"
    assert len(probes) == 1
    errors = []
    for _ in range(3):  # three forwards that ask for flash_varlen on this CPU
        with pytest.raises(BackendUnavailableError, match="needs a CUDA device") as caught:
            tree_layout(ROW, "cpu", "flash_varlen")
        errors.append(caught.value)
    assert len(probes) == 2  # one more device, probed once
    assert errors[0] is errors[1] is errors[2]
    assert "missing on device cpu: a CUDA device and the `kernels` package" in str(errors[0])


def test_a_dense_layout_without_its_mask_is_refused_not_attended_unmasked() -> None:
    layout = attrs.evolve(tree_layout(ROW, "cpu", "dense"), dense_mask=None)
    query = torch.randn(HEADS, ROW.num_tokens, HEAD_DIM)
    key, value = (torch.randn(KV_HEADS, ROW.num_tokens, HEAD_DIM) for _ in range(2))
    with pytest.raises(ValueError, match="'dense' needs the layout's dense_mask"):
        backends.attend(query, key, value, layout, scaling=0.3)


def test_unknown_backend_is_named() -> None:
    with pytest.raises(ValueError, match="unknown tree attention backend 'sparse'"):
        check_backend("sparse", "cpu")


def test_forward_without_a_layout_names_the_keyword(tiny_qwen3) -> None:
    model = enable_tree_attention(load_causal_lm(tiny_qwen3))
    with pytest.raises(ValueError, match="tree_layout=TreeLayout"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    layout = tree_layout(ROW, "cpu")
    with pytest.raises(ValueError, match="one packed row"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False, tree_layout=layout)
