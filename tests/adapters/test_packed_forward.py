"""The packed forward equals forwarding each sample alone, in values and in gradients, on
real tiny Qwen3 and Llama models (fp32, CPU)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from packing_strategies import make_sample, sample_sets

from asyncgrpo.adapters.kernels.attention import enable_tree_attention
from asyncgrpo.adapters.kernels.backends import choose_backend
from asyncgrpo.adapters.kernels.packed_forward import packed_log_probs, row_tensors
from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.core.loss.inputs import SamplerTopK
from asyncgrpo.core.packing.tree import pack_row

ROW = pack_row(
    [
        make_sample([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]),
        make_sample([1, 2, 3, 7, 8, 9], [0, 0, 0, 1, 1, 1]),
        make_sample([1, 2, 3, 7, 8], [0, 0, 0, 1, 1]),
        make_sample([5, 6, 6, 2], [0, 1, 1, 1]),
    ]
)


class Models:
    """One architecture's weights twice: ``stock`` attention and ``tree`` attention."""

    def __init__(self, path) -> None:
        self.path = path
        self.stock = load_causal_lm(path)
        self.tree = enable_tree_attention(load_causal_lm(path))

    def __repr__(self) -> str:
        return f"Models({self.path.name})"


@pytest.fixture(scope="module", params=["tiny_qwen3", "tiny_llama"])
def models(request) -> Models:
    return Models(request.getfixturevalue(request.param))


def unpacked_logits(model, samples) -> torch.Tensor:
    """float [N, V]: each sample forwarded alone, the logits predicting its trained tokens."""
    rows = [torch.zeros(0, model.config.vocab_size)]
    for sample in samples:
        positions = torch.from_numpy(np.flatnonzero(sample.sequence.trained_mask))
        if len(positions):
            ids = torch.tensor(sample.sequence.input_ids)[None]
            rows.append(model(input_ids=ids, use_cache=False).logits[0, positions - 1])
    return torch.cat(rows)


def reference(logits, targets, temperature, candidate_mask=None):
    scaled = logits / temperature
    if candidate_mask is not None:
        scaled = scaled.masked_fill(~candidate_mask, -math.inf)
    logp_all = torch.log_softmax(scaled, -1)
    entropy = -(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)).sum(-1)
    return logp_all, logp_all.gather(-1, targets[:, None])[:, 0], entropy


def gradients(model) -> list[torch.Tensor]:
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def assert_gradients_close(got, want, rel) -> None:
    """Every gradient entry within ``rel`` of itself or of the model's largest gradient entry.

    The second bound covers parameters whose exact gradient is 0 (q/k projections when every
    prediction comes from a row that attends only to itself, or behind the pad token's zero
    embedding): one forward returns 0 there, the other rounding noise.
    """
    scale = max(w.abs().max() for w in want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=rel, atol=rel * scale)


def random_topk(n, vocab, k, generator) -> SamplerTopK:
    ids = torch.randint(0, vocab, (n, k), generator=generator)
    logp = torch.log_softmax(torch.randn(n, k, generator=generator), -1)
    valid = torch.rand(n, k, generator=generator) < 0.8
    return SamplerTopK(ids.masked_fill(~valid, -1), logp, valid)


@settings(max_examples=25)
@given(
    samples=sample_sets(max_groups=3, max_per_group=4, max_len=8),
    temperature=st.sampled_from([0.6, 1.0, 1.7]),
    seed=st.integers(0, 2**16),
)
def test_packed_equals_unpacked_forward_and_gradients(models, samples, temperature, seed) -> None:
    stock, tree = models.stock, models.tree
    row = pack_row(samples)
    assume(len(row.target_ids) > 0)
    weights = torch.randn(len(row.target_ids), generator=torch.Generator().manual_seed(seed))

    packed = packed_log_probs(tree, row, temperature)
    (packed.logp * weights).sum().backward()
    logits = unpacked_logits(stock, samples)
    _, logp, entropy = reference(logits, torch.tensor(row.target_ids), temperature)
    (logp * weights).sum().backward()

    torch.testing.assert_close(packed.logp, logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed.entropy, entropy.detach(), rtol=0, atol=1e-5)
    assert_gradients_close(gradients(tree), gradients(stock), rel=1e-5)


def test_segments_equal_dense_through_the_model(models) -> None:
    tree = models.tree
    weights = torch.linspace(-1.0, 1.0, len(ROW.target_ids))
    results = {}
    for backend in ("dense", "segments"):
        out = packed_log_probs(tree, ROW, temperature=0.8, backend=backend)
        (out.logp * weights).sum().backward()
        results[backend] = (out.logp.detach(), out.entropy, gradients(tree))
    (dense_logp, dense_entropy, dense_grads) = results["dense"]
    (logp, entropy, grads) = results["segments"]
    torch.testing.assert_close(logp, dense_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, dense_entropy, rtol=1e-6, atol=1e-6)
    assert_gradients_close(grads, dense_grads, rel=1e-5)


def test_chunk_size_does_not_change_results(models) -> None:
    tree = models.tree
    generator = torch.Generator().manual_seed(0)
    n, vocab = len(ROW.target_ids), tree.config.vocab_size
    topk = random_topk(n, vocab, 6, generator)
    candidates = torch.rand(n, vocab, generator=generator) < 0.5
    candidates[torch.arange(n), torch.tensor(ROW.target_ids)] = True
    weights = torch.randn(n, 6, generator=generator)
    results = []
    for chunk_size in (1, 3, 1024):
        out = packed_log_probs(
            tree, ROW, 0.9, topk=topk, candidate_mask=candidates, chunk_size=chunk_size
        )
        finite = torch.where(topk.valid, out.topk_logp, 0.0)
        (out.logp.sum() + (finite * weights).sum()).backward()
        results.append((out, gradients(tree)))
    (first, first_grads), *others = results
    for out, grads in others:
        for field in ("logp", "entropy", "topk_logp"):
            got, want = getattr(out, field), getattr(first, field)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert_gradients_close(grads, first_grads, rel=1e-6)


def test_topk_and_candidate_mask_equal_indexing_the_full_log_softmax(models) -> None:
    stock, tree = models.stock, models.tree
    generator = torch.Generator().manual_seed(1)
    n, vocab = len(ROW.target_ids), tree.config.vocab_size
    targets = torch.tensor(ROW.target_ids)
    topk = random_topk(n, vocab, 5, generator)
    candidates = torch.rand(n, vocab, generator=generator) < 0.3
    candidates[torch.arange(n), targets] = True
    with torch.no_grad():
        logits = unpacked_logits(stock, ROW.samples)
        for mask in (None, candidates):
            out = packed_log_probs(tree, ROW, 1.3, topk=topk, candidate_mask=mask, chunk_size=2)
            logp_all, logp, entropy = reference(logits, targets, 1.3, mask)
            want = logp_all.gather(-1, topk.ids.clamp(min=0)).masked_fill(~topk.valid, -math.inf)
            torch.testing.assert_close(out.topk_logp, want, rtol=0, atol=1e-5)
            torch.testing.assert_close(out.logp, logp, rtol=0, atol=1e-5)
            torch.testing.assert_close(out.entropy, entropy, rtol=0, atol=1e-5)


def test_only_the_last_chunks_logits_are_kept_for_backward(models) -> None:
    tree = models.tree
    vocab = tree.config.vocab_size
    saved_shapes = []

    def keep_shape(tensor):
        saved_shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep_shape, lambda tensor: tensor):
        out = packed_log_probs(tree, ROW, 1.0, chunk_size=2)
    out.logp.sum().backward()
    gradients(tree)
    last_chunk = (len(ROW.target_ids) - 1) % 2 + 1
    assert [s for s in saved_shapes if s[-1] == vocab] == [(last_chunk, vocab)]


def test_gradient_checkpointing_passes_the_layout_through(models) -> None:
    checkpointed = enable_tree_attention(load_causal_lm(models.path)).train()
    checkpointed.gradient_checkpointing_enable({"use_reentrant": False})
    results = []
    for model in (models.tree, checkpointed):
        out = packed_log_probs(model, ROW, 1.0)
        out.logp.sum().backward()
        results.append((out.logp.detach(), gradients(model)))
    (logp, grads), (want_logp, want_grads) = results
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-6)
    assert_gradients_close(grads, want_grads, rel=1e-6)


def test_row_without_trained_tokens_gives_empty_results(models) -> None:
    tree = models.tree
    row = pack_row([make_sample([1, 2, 3], [0, 0, 0])])
    empty = torch.zeros(0, 4)
    topk = SamplerTopK(empty.long(), empty, empty.bool())
    out = packed_log_probs(tree, row, 1.0, topk=topk)
    assert out.logp.shape == out.entropy.shape == (0,) and out.topk_logp.shape == (0, 4)


def test_row_tensors_carry_the_row_on_the_device() -> None:
    tensors = row_tensors(ROW, "cpu")
    assert tensors.input_ids.shape == tensors.position_ids.shape == (1, ROW.num_tokens)
    assert tensors.position_ids[0].tolist() == ROW.position_ids.tolist()
    assert tensors.predict_index.dtype == tensors.target_ids.dtype == torch.long
    assert tensors.layout.backend == choose_backend("cpu").for_row(ROW)  # by cost (test_attention)


def test_model_without_tree_attention_is_refused(models) -> None:
    stock = models.stock
    with pytest.raises(ValueError, match=r"enable_tree_attention\(model\)"):
        packed_log_probs(stock, ROW, 1.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        packed_log_probs(stock, ROW, 1.0, chunk_size=0)
