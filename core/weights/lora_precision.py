"""LoRA merged into weights of lower precision: whether the server can hold the update.

A PEFT run whose server was started without ``--enable-lora`` syncs merged weights
``W' = W + scaling * (B @ A)``. The merge is computed in float32; the server holds ``W'``
rounded to its own dtype (and the trainer exports it in bf16 under bf16 training). Where the
update of an entry is below half the spacing of that dtype near ``W``, ``W'`` rounds back to
what the server already holds: bf16 keeps 8 significant bits, so a weight near 0.02 is held to
within 6.1e-5 (spacing 2^-13 = 1.2e-4), and LoRA updates near 1e-5 (the first steps of a run at
a learning rate of 1e-5 to 1e-4) vanish there. The server then samples from a policy the
trainer does not hold.

:func:`lost_update` counts, over the adapted matrices, the entries whose update is non-zero in
float32 (``changed``) and, of those, the ones whose merged value rounds to the same value as
the base through every cast on the way to the server (``lost``). :func:`check_merged_sync`
refuses a merged push when more than :data:`MAX_LOST_FRACTION` of the changed entries are lost.
A freshly initialised LoRA (``B = 0``) changes nothing yet and is never refused.

Example:
    >>> import torch
    >>> base = torch.full((4,), 0.02)
    >>> counts = lost_update(base, base + 1e-5, (torch.bfloat16,))
    >>> counts, counts.lost_fraction
    (UpdateCounts(changed=4, lost=4), 1.0)
    >>> check_merged_sync(counts, "torch.bfloat16", "float32").refused
    True
    >>> check_merged_sync(lost_update(base, base + 1e-5, ()), "float32", "float32").refused
    False
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from asyncgrpo.core.weights.parity import dtype_name

MAX_LOST_FRACTION = 0.5
"""A merged push is refused when more than this share of the entries the LoRA update changes
round back to the base weights on the server. Above half, the server's policy is closer to the
base model than to the trainer's; below it the update reaches the server, coarsened (every
entry is then held to the dtype's resolution anyway, as a model served in bf16 always is)."""

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The dtypes a vLLM server holds weights in, by
:func:`~asyncgrpo.core.weights.parity.dtype_name`."""

_SIGNIFICANT_BITS = {"float32": 24, "float16": 11, "bfloat16": 8}


@attrs.frozen
class UpdateCounts:
    """Entries of the adapted matrices a merged push changes, and how many of those the
    rounding to the server's dtype loses.

    Attributes:
        changed: entries where the float32 merge differs from the base weight (>= 0).
        lost: of those, entries whose merged value rounds to the base's rounded value
            (``0 <= lost <= changed``).
    """

    changed: int = 0
    lost: int = 0

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.lost <= self.changed:
            raise ValueError(f"UpdateCounts: need 0 <= lost <= changed, got {self}")

    def __add__(self, other: UpdateCounts) -> UpdateCounts:
        return UpdateCounts(self.changed + other.changed, self.lost + other.lost)

    @property
    def lost_fraction(self) -> float:
        """``lost / changed``; 0 when nothing changed (a fresh adapter)."""
        return self.lost / self.changed if self.changed else 0.0


def rounded_through(tensor: torch.Tensor, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """``tensor`` cast through each of ``dtypes`` in turn (what a weight becomes on its way to
    the server: the merge's output dtype, the export dtype, the server's dtype)."""
    for dtype in dtypes:
        tensor = tensor.to(dtype)
    return tensor


SAMPLED_ENTRIES = 1 << 16
"""The most entries of one matrix :func:`lost_update` compares when given ``max_entries``: an
evenly strided sample (an odd stride, so that every column of a power-of-two row is visited).
The lost share of a larger matrix is then estimated to within 0.4% (two standard errors at
worst, a share of one half), and a merged push's check costs about as much for a 8B model as
for a 1B one, instead of two casts and comparisons of every weight."""


def lost_update(
    base: torch.Tensor,
    merged: torch.Tensor,
    dtypes: Sequence[torch.dtype],
    max_entries: int | None = None,
) -> UpdateCounts:
    """How many entries the update changes, and how many of those rounding loses.

    Args:
        base: the base weight as the learner holds it, any float dtype, shape S.
        merged: the merge ``base + update`` computed in float32, shape S.
        dtypes: the casts the weight goes through before the server holds it, in order (empty:
            none, nothing is lost).
        max_entries: count only an evenly strided sample of about this many entries (``None``:
            all); see :data:`SAMPLED_ENTRIES`.

    Returns:
        ``changed``: entries with ``merged != base`` (compared in float32); ``lost``: of those,
        entries where ``merged`` and ``base``, both cast through ``dtypes``, are equal.

    Example:
        >>> base = torch.zeros(10)
        >>> lost_update(base, base + 1.0, (), max_entries=4)  # entries 0, 3, 6, 9
        UpdateCounts(changed=4, lost=0)
    """
    if base.shape != merged.shape:
        raise ValueError(f"lost_update: base {tuple(base.shape)} vs merged {tuple(merged.shape)}")
    base, merged = base.reshape(-1), merged.reshape(-1)
    if max_entries is not None and base.numel() > max_entries:
        stride = (base.numel() // max_entries) | 1
        base, merged = base[::stride].contiguous(), merged[::stride].contiguous()
    changed = merged.float() != base.float()
    same = rounded_through(merged, dtypes) == rounded_through(base, dtypes)
    return UpdateCounts(int(changed.sum()), int((changed & same).sum()))


def coarsest(names: Sequence[str]) -> str:
    """The dtype of fewest significant bits among ``names`` (``dtype_name`` spellings).

    Example:
        >>> coarsest(["float32", "torch.bfloat16", "fp16"])
        'bfloat16'
    """
    return min((dtype_name(n) for n in names), key=_SIGNIFICANT_BITS.__getitem__)


@attrs.frozen
class MergedSyncCheck:
    """The verdict on one merged push of a PEFT model.

    Attributes:
        counts: the push's :class:`UpdateCounts` over every adapted matrix.
        refused: more than ``max_lost`` of the changed entries are lost.
        message: why it is refused and what to do ("" when not refused).
    """

    counts: UpdateCounts
    refused: bool
    message: str


def check_merged_sync(
    counts: UpdateCounts,
    server_dtype: str | None,
    export_dtype: str,
    max_lost: float = MAX_LOST_FRACTION,
) -> MergedSyncCheck:
    """Whether a merged push leaves the server holding the trainer's policy.

    Args:
        counts: :func:`lost_update` summed over the adapted matrices, through the export dtype
            and the server's dtype.
        server_dtype: the server's ``model_config.dtype`` (``/server_info``); unknown counts
            as bfloat16 (:func:`~asyncgrpo.core.weights.parity.dtype_name`).
        export_dtype: the dtype the trainer exports merged weights in.
        max_lost: the largest share of lost entries accepted (in [0, 1)).

    Example:
        >>> check = check_merged_sync(UpdateCounts(100, 88), "torch.bfloat16", "float32")
        >>> check.refused, "--enable-lora" in check.message, "--dtype float32" in check.message
        (True, True, True)
    """
    if not 0.0 <= max_lost < 1.0:
        raise ValueError(f"check_merged_sync: max_lost must be in [0, 1), got {max_lost}")
    if counts.changed == 0 or counts.lost_fraction <= max_lost:
        return MergedSyncCheck(counts, refused=False, message="")
    server, export = dtype_name(server_dtype), dtype_name(export_dtype)
    held = coarsest([server, export])
    where = []
    fixes = [
        "Start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 to sync the "
        "adapter itself"
    ]
    if server == held:
        where.append(f"the vLLM server's dtype is {server}")
        fixes.append("serve float32 weights (vLLM --dtype float32)")
    if export == held:
        where.append(f"the trainer exports {export} weights")
        fixes.append("train with float32 weights (bf16=False, dtype='float32')")
    return MergedSyncCheck(
        counts,
        refused=True,
        message=(
            f"LoRA merged into the weights does not reach the vLLM server: {counts.lost:,} of "
            f"the {counts.changed:,} weight entries the adapter changes "
            f"({counts.lost_fraction:.1%}, more than {max_lost:.0%}) round back to the base "
            f"weights in {held} ({' and '.join(where)}), so the server would sample from a "
            f"policy this trainer does not hold. {'; or '.join(fixes)}"
        ),
    )
