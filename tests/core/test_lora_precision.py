"""LoRA merged into lower-precision weights: the share of the update rounding loses, and the
refusal of a merged push that loses most of it."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.weights.lora_precision import (
    MAX_LOST_FRACTION,
    UpdateCounts,
    check_merged_sync,
    coarsest,
    lost_update,
)

N = 4096  # entries of one weight matrix


def weights(seed: int, magnitude: float) -> torch.Tensor:
    """[N] float32 base weights of about ``magnitude``, both signs (as a layer's weights)."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0)
    return sign * magnitude * (1.0 + torch.rand(N, generator=g))


def update(seed: int, base: torch.Tensor, relative: float) -> torch.Tensor:
    """[N] a non-zero update of ``relative`` times each entry's magnitude (either sign)."""
    g = torch.Generator().manual_seed(seed + 1)
    sign = torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0)
    return sign * relative * base.abs() * (1.0 + torch.rand(N, generator=g))


seeds = st.integers(0, 2**16)
magnitudes = st.sampled_from([1e-3, 0.02, 0.5])


@given(seeds, magnitudes, st.floats(1e-6, 1.0))
def test_nothing_is_lost_when_the_server_holds_the_merge_dtype(seed, magnitude, relative) -> None:
    base = weights(seed, magnitude)
    merged = base + update(seed, base, relative)
    for chain in [(), (torch.float32,), (torch.float32, torch.float32)]:
        counts = lost_update(base, merged, chain)
        assert counts.lost == 0 and counts.lost_fraction == 0.0
        assert counts.changed == int((merged != base).sum()) > N // 2
        assert not check_merged_sync(counts, "torch.float32", "float32").refused


@given(seeds, magnitudes, st.floats(1e-6, 2.0**-14))
def test_an_update_far_below_bf16_resolution_is_lost(seed, magnitude, relative) -> None:
    """bf16 keeps 8 significant bits: an entry is held to half its spacing, >= 2^-9 of it. An
    update under 2^-14 of the entry (and above float32's 2^-24, so the merge changes it)
    crosses a rounding boundary for a few entries at most."""
    base = weights(seed, magnitude)
    merged = base + update(seed, base, relative)
    for chain in [(torch.bfloat16,), (torch.float32, torch.bfloat16)]:
        counts = lost_update(base, merged, chain)
        assert counts.changed > N // 2
        assert counts.lost_fraction > 0.9
    check = check_merged_sync(counts, "torch.bfloat16", "torch.float32")
    assert check.refused
    assert "--enable-lora" in check.message and "bfloat16" in check.message


@given(seeds, magnitudes, st.floats(2.0**-5, 1.0))
def test_an_update_well_above_bf16_resolution_is_kept(seed, magnitude, relative) -> None:
    """An update of at least 4 spacings (2^-7 of the entry each) moves every rounded entry."""
    base = weights(seed, magnitude)
    merged = base + update(seed, base, relative)
    counts = lost_update(base, merged, (torch.bfloat16,))
    assert counts.changed == N and counts.lost == 0
    assert not check_merged_sync(counts, "torch.bfloat16", "bfloat16").refused


@given(seeds, st.sampled_from(["torch.bfloat16", "torch.float16", None, "float32"]))
def test_a_fresh_adapter_changes_nothing_and_is_never_refused(seed, server_dtype) -> None:
    """LoRA starts with B = 0: the first merged push equals the base weights."""
    base = weights(seed, 0.02)
    counts = lost_update(base, base.clone(), (torch.bfloat16,))
    assert counts == UpdateCounts(0, 0) and counts.lost_fraction == 0.0
    assert not check_merged_sync(counts, server_dtype, "bfloat16").refused


@given(st.integers(1, 10_000), st.floats(0.0, 1.0), st.floats(0.0, 0.99))
def test_refused_iff_more_than_the_limit_is_lost(changed, share, limit) -> None:
    counts = UpdateCounts(changed, round(share * changed))
    check = check_merged_sync(counts, "torch.bfloat16", "float32", max_lost=limit)
    assert check.refused == (counts.lost_fraction > limit)
    assert (check.message == "") != check.refused


def test_the_refusal_names_the_fix_for_whichever_dtype_loses_it() -> None:
    lost = UpdateCounts(1000, 880)
    server = check_merged_sync(lost, "torch.bfloat16", "torch.float32").message
    assert "88.0%" in server and "880 of the 1,000" in server
    assert "--enable-lora" in server and "the vLLM server's dtype is bfloat16" in server
    assert "--dtype float32" in server and "bf16=False" not in server
    export = check_merged_sync(lost, "torch.float32", "torch.bfloat16").message
    assert "--enable-lora" in export and "the trainer exports bfloat16 weights" in export
    assert "bf16=False" in export and "--dtype float32" not in export
    unknown = check_merged_sync(lost, None, "float32").message  # counted as bfloat16
    assert "the vLLM server's dtype is bfloat16" in unknown
    assert MAX_LOST_FRACTION == 0.5


def test_counts_add_and_check_their_bounds() -> None:
    assert UpdateCounts(3, 1) + UpdateCounts(2, 2) == UpdateCounts(5, 3)
    assert coarsest(["float32", "fp16"]) == "float16"
    with pytest.raises(ValueError, match="lost <= changed"):
        UpdateCounts(1, 2)
    with pytest.raises(ValueError, match="base"):
        lost_update(torch.zeros(2), torch.zeros(3), ())
    with pytest.raises(ValueError, match="max_lost"):
        check_merged_sync(UpdateCounts(), "float32", "float32", max_lost=1.0)
