"""The packed forward is exact for the attention parts beyond full causal attention: sliding
windows (gpt-oss, Gemma 2/3, OLMo 3, Mistral), chunked attention (Llama 4 text), attention sinks
(gpt-oss), attention logit soft-capping (Gemma 2), final-logit soft-capping (Gemma 2/3) and
logit scales (Cohere).

Tiny random models built from transformers' own configs (fp32, CPU): packed log-probs and
gradients equal each sample forwarded alone with eager attention, on random tries whose samples
are longer than the window and the chunk. Each part has a negative control, the packed forward
with that part left out, which must differ by far more than the tolerance.
"""

import copy
import functools
import math

import attrs
import families
import numpy as np
import pytest
import structlog
import torch
import transformers as tf
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from packing_strategies import make_sample, sample_sets
from torch.nn.attention.flex_attention import flex_attention
from transformers import AutoModelForCausalLM

from asyncgrpo.adapters.kernels import attention, backends, packed_forward
from asyncgrpo.adapters.kernels.architecture_support import check_tree_packing_support
from asyncgrpo.adapters.kernels.attention import enable_tree_attention, tree_layout
from asyncgrpo.adapters.kernels.attention_parts import AttentionParts, model_attention_parts
from asyncgrpo.adapters.kernels.backends import BackendChoice, ModelAttention
from asyncgrpo.adapters.kernels.lm_head_log_probs import IDENTITY, LogitTransform
from asyncgrpo.adapters.kernels.packed_forward import packed_log_probs
from asyncgrpo.core.packing.memory import LINEAR, QUADRATIC
from asyncgrpo.core.packing.tree import pack_row

WINDOW = 4
CHUNK = 4
LOGP_TOLERANCE = 1e-5  # as test_packed_forward.py: log-probs of order 10 round by ~1e-6
# per parameter, relative to that parameter's gradient norm: rounding reaches 1.1e-5 on Llama 4
# (its routers) on some drawn rows (2026-12-06, over 10 hypothesis seeds)
GRADIENT_TOLERANCE = 5e-5
GRADIENT_NORM_FLOOR = 1e-2  # of the model's largest gradient norm (see largest_differences)
CONTROL_DIFFERENCE = 1e-2  # a part left out moves some log-prob by at least this much

SMALL = {**families.SMALL, "head_dim": 16}
SLIDING_THEN_FULL = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)

CONFIGS = {
    "gpt_oss": lambda: tf.GptOssConfig(
        **SMALL, num_local_experts=2, num_experts_per_tok=1, **SLIDING_THEN_FULL
    ),
    "gemma2": lambda: tf.Gemma2Config(
        **SMALL, **SLIDING_THEN_FULL, attn_logit_softcapping=1.0, final_logit_softcapping=2.0
    ),
    "gemma3": lambda: tf.Gemma3TextConfig(
        **SMALL, **SLIDING_THEN_FULL, final_logit_softcapping=2.0
    ),
    "olmo3": lambda: tf.Olmo3Config(**SMALL, **SLIDING_THEN_FULL),
    # Layer 0 chunked with RoPE, layer 1 full attention without RoPE and with the query
    # temperature (floor_scale 2, so that it changes every other position).
    "llama4_text": lambda: tf.Llama4TextConfig(
        **SMALL,
        intermediate_size_mlp=64,
        num_local_experts=2,
        attention_chunk_size=CHUNK,
        no_rope_layer_interval=2,
        floor_scale=2,
        attn_scale=0.5,
    ),
    "mistral": lambda: tf.MistralConfig(**SMALL, sliding_window=WINDOW),
    "cohere": lambda: tf.CohereConfig(**SMALL, logit_scale=0.25),
}

# One long row: samples of 9-14 tokens sharing prefixes, longer than the window and the chunk.
LONG_ROW = pack_row(
    [
        make_sample(range(1, 12), [0] * 5 + [1] * 6),
        make_sample([*range(1, 7), 17, 18, 19, 20, 21, 22, 23, 24], [0] * 5 + [1] * 9),
        make_sample([*range(1, 7), 17, 18, 30, 31], [0] * 5 + [1] * 5),
        make_sample([3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 0] + [1] * 7),
    ]
)


class Models:
    """One family's random weights twice: ``stock`` (eager attention) and ``tree``."""

    def __init__(self, family: str) -> None:
        torch.manual_seed(0)
        config = CONFIGS[family]()
        self.stock = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        for module in self.stock.modules():  # sinks of order 1, so that they matter
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                torch.nn.init.normal_(module.sinks, std=1.0)
        self.tree = enable_tree_attention(copy.deepcopy(self.stock))


@functools.cache
def models(family: str) -> Models:
    return Models(family)


def reference_log_probs(model, samples, targets) -> torch.Tensor:
    """float [N]: each sample forwarded alone, the log-probs of its trained tokens."""
    logits = [torch.zeros(0, model.config.vocab_size)]
    for sample in samples:
        positions = torch.from_numpy(np.flatnonzero(sample.sequence.trained_mask))
        if len(positions):
            ids = torch.tensor(sample.sequence.input_ids)[None]
            logits.append(model(input_ids=ids, use_cache=False).logits[0, positions - 1])
    logp_all = torch.log_softmax(torch.cat(logits), -1)
    return logp_all.gather(-1, targets[:, None])[:, 0]


def gradients(model) -> list[torch.Tensor]:
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def largest_differences(family, row, backend="segments", weights_seed=0) -> tuple[float, float]:
    """(largest |packed - unpacked| log-prob, largest per-parameter gradient difference relative
    to that parameter's gradient norm) of ``row``'s samples in ``family``'s models.

    A parameter's norm counts at least :data:`GRADIENT_NORM_FLOOR` of the model's largest: a
    gradient that small is a sum that mostly cancels (Llama 4's second router, 0.3% of the
    largest on one trained token, differs by 1.7e-4 of itself between eager attention and
    SDPA on a single sample, which involves no packing at all)."""
    pair = models(family)
    targets = torch.tensor(row.target_ids)
    weights = torch.randn(len(targets), generator=torch.Generator().manual_seed(weights_seed))
    packed = packed_log_probs(pair.tree, row, 1.0, backend=backend)
    (packed.logp * weights).sum().backward()
    logp = reference_log_probs(pair.stock, row.samples, targets)
    (logp * weights).sum().backward()
    dlogp = (packed.logp - logp).abs().max().item()
    got, want = gradients(pair.tree), gradients(pair.stock)
    # a row whose trained tokens see only the padding token's zero embedding (id 0 in some
    # configs) has no gradient anywhere: the floor keeps its 0 / 0 a 0
    largest_norm = max(max(w.norm() for w in want), torch.finfo(torch.float32).tiny)
    relative = max(
        ((g - w).norm() / max(w.norm(), GRADIENT_NORM_FLOOR * largest_norm)).item()
        for g, w in zip(got, want, strict=True)
    )
    return dlogp, relative


@pytest.mark.parametrize("family", sorted(CONFIGS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    samples=sample_sets(max_groups=2, max_per_group=3, vocab=12, max_len=8),
    backend=st.sampled_from(["dense", "segments"]),
    seed=st.integers(0, 2**16),
)
def test_packed_equals_per_sample_forwards(family, samples, backend, seed) -> None:
    row = pack_row(samples)
    assume(len(row.target_ids) > 0)
    assume(max(len(s.sequence.input_ids) for s in samples) > max(WINDOW, CHUNK) + 1)
    dlogp, relative = largest_differences(family, row, backend, seed)
    assert dlogp <= LOGP_TOLERANCE
    assert relative <= GRADIENT_TOLERANCE


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("backend", ["dense", "segments"])
def test_the_long_row_is_exact(family, backend) -> None:
    dlogp, relative = largest_differences(family, LONG_ROW, backend)
    assert dlogp <= LOGP_TOLERANCE
    assert relative <= GRADIENT_TOLERANCE


def _leaving_out(real_attend, **changes):
    """``attend`` with the layer's parts changed by ``changes`` (``sinks=False`` drops the
    sink logits too)."""

    def attend(q, k, v, layout, scaling, parts, sinks):
        if changes.get("sinks") is False:
            sinks = None
        return real_attend(q, k, v, layout, scaling, attrs.evolve(parts, **changes), sinks)

    return attend


CONTROLS = {
    ("gpt_oss", "sliding window"): {"attend": {"window": None}},
    ("gemma2", "sliding window"): {"attend": {"window": None}},
    ("gemma3", "sliding window"): {"attend": {"window": None}},
    ("olmo3", "sliding window"): {"attend": {"window": None}},
    ("mistral", "sliding window"): {"attend": {"window": None}},
    ("llama4_text", "chunked attention"): {"attend": {"chunk": None}},
    ("gpt_oss", "attention sinks"): {"attend": {"sinks": False}},
    ("gemma2", "attention logit soft-cap"): {"attend": {"softcap": None}},
    ("gemma2", "final-logit soft-cap"): {"transform": IDENTITY},
    ("gemma3", "final-logit soft-cap"): {"transform": IDENTITY},
    ("cohere", "logit scale"): {"transform": IDENTITY},
    ("llama4_text", "query temperature along paths"): {"temperature": True},
}


@pytest.mark.parametrize(("family", "part"), sorted(CONTROLS), ids=lambda x: x.replace(" ", "-"))
def test_leaving_a_part_out_breaks_the_match(family, part, monkeypatch) -> None:
    control = CONTROLS[(family, part)]
    if "attend" in control:
        monkeypatch.setattr(attention, "attend", _leaving_out(backends.attend, **control["attend"]))
    if "transform" in control:
        monkeypatch.setattr(LogitTransform, "of", classmethod(lambda cls, config: IDENTITY))
    if "temperature" in control:
        monkeypatch.setattr(
            attention, "_query_temperature_along_paths", lambda module, query, layout: query
        )
    dlogp, _ = largest_differences(family, LONG_ROW)
    assert dlogp > CONTROL_DIFFERENCE, f"leaving out the {part} of {family} changed too little"


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_families_are_accepted_with_their_parts_declared(family) -> None:
    model = models(family).stock
    check_tree_packing_support(model)
    parts = model_attention_parts(model)
    assert len(parts) == 2
    names = set().union(*(layer.names for layer in parts))
    expected = {
        "gpt_oss": {"sliding_window", "attention_sinks"},
        "gemma2": {"sliding_window", "logit_softcapping"},
        "gemma3": {"sliding_window"},
        "olmo3": {"sliding_window"},
        "llama4_text": {"chunked_attention"},
        "mistral": {"sliding_window"},
        "cohere": set(),
    }[family]
    assert names == expected


@settings(max_examples=10, deadline=None)
@given(
    samples=sample_sets(max_groups=2, max_per_group=3, vocab=6, max_len=8),
    window=st.sampled_from([None, 2, 3]),
    chunk=st.sampled_from([None, 2, 4]),
    softcap=st.sampled_from([None, 0.5]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_masks_and_score_mod_equal_dense(samples, window, chunk, softcap, seed) -> None:
    """FlexAttention's forward runs on CPU uncompiled (its backward does not): its block masks
    and soft-cap equal the dense backend's."""
    row = pack_row(samples)
    parts = AttentionParts(window=window, chunk=chunk, softcap=softcap)
    generator = torch.Generator().manual_seed(seed)
    t = row.num_tokens
    q = torch.randn(4, t, 16, generator=generator) * 2
    k, v = (torch.randn(2, t, 16, generator=generator) * 2 for _ in range(2))
    shape = ModelAttention(64, 1, (parts,))
    flex_choice = BackendChoice("flex", LINEAR, "test")
    flex_layout = tree_layout(row, "cpu", flex_choice, shape)
    dense_layout = tree_layout(row, "cpu", "dense", shape)
    got = backends._flex(q, k, v, flex_layout, 0.25, parts, None, flex=flex_attention)
    want = backends.attend(q, k, v, dense_layout, 0.25, parts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_backend_without_a_part_gives_the_row_to_one_with_it_logged_once() -> None:
    backends._log_backend_change.cache_clear()
    window = ModelAttention(64, 2, (AttentionParts(window=WINDOW), AttentionParts()))
    sinks = ModelAttention(64, 2, (AttentionParts(sinks=True),))
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert BackendChoice("flash_varlen", LINEAR, "").for_row(LONG_ROW, window) == "flex"
            assert BackendChoice("flex", LINEAR, "").for_row(LONG_ROW, sinks) == "segments"
            assert BackendChoice("flex", LINEAR, "").for_row(LONG_ROW, window) == "flex"
    assert [(entry["backend"], entry["to"]) for entry in logs] == [
        ("flash_varlen", "flex"),
        ("flex", "segments"),
    ]
    assert "lacks sliding_window" in logs[0]["reason"]
    assert "lacks attention_sinks" in logs[1]["reason"]


def test_the_runs_choice_with_the_models_shape_has_the_replacements_memory(monkeypatch) -> None:
    monkeypatch.setattr(
        backends, "_choose_backend", lambda device, requested: BackendChoice("flex", LINEAR, "gpu")
    )
    sinks = ModelAttention(64, 2, (AttentionParts(window=WINDOW, sinks=True),))
    choice = backends.choose_backend("cuda", shape=sinks)
    assert (choice.backend, choice.memory) == ("segments", QUADRATIC)
    assert (
        choice.reason
        == "gpu; 'flex' lacks attention_sinks; 'segments' has every part the model needs"
    )
    window = ModelAttention(64, 2, (AttentionParts(window=WINDOW),))
    assert backends.choose_backend("cuda", shape=window).backend == "flex"


def test_a_layout_without_the_models_parts_is_refused() -> None:
    layout = tree_layout(LONG_ROW, "cpu", BackendChoice("torch_varlen", LINEAR, ""))
    x = torch.zeros(2, LONG_ROW.num_tokens, 16)
    with pytest.raises(ValueError, match=r"does not implement sliding_window.*ModelAttention"):
        backends.attend(x, x, x, layout, None, AttentionParts(window=WINDOW))


@pytest.mark.parametrize(
    "transform", [LogitTransform(softcap=2.0), LogitTransform(scale=0.25), LogitTransform(0.5, 3.0)]
)
def test_the_logit_transforms_gradient_is_autograds(transform) -> None:
    z = (torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 4).requires_grad_()
    upstream = torch.randn(5, 7)
    (transform(z) * upstream).sum().backward()
    torch.testing.assert_close(transform.backward(z.detach(), upstream), z.grad)
    assert not math.isclose(transform(z).sum().item(), z.sum().item())


def test_the_no_grad_forward_applies_the_logit_transform() -> None:
    pair = models("gemma2")
    targets = torch.tensor(LONG_ROW.target_ids)
    with torch.no_grad():
        packed = packed_forward.packed_log_probs(pair.tree, LONG_ROW, 0.7)
        logits = []
        for sample in LONG_ROW.samples:
            positions = torch.from_numpy(np.flatnonzero(sample.sequence.trained_mask))
            ids = torch.tensor(sample.sequence.input_ids)[None]
            logits.append(pair.stock(input_ids=ids).logits[0, positions - 1])
        want = torch.log_softmax(torch.cat(logits) / 0.7, -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(packed.logp, want, rtol=0, atol=LOGP_TOLERANCE)
