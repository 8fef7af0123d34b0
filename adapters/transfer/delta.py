"""Delta weight pushes: which elements changed since the last push, as patches, the byte
layout they travel in, and how the server applies them (:mod:`asyncgrpo.core.weights.delta`
decides what each tensor's patch is).

On the trainer, :class:`DeltaEncoder` keeps a copy of the last pushed policy in the server's
dtype (one copy of the synced weights, where the push reads them) and compares each new tensor
with it bit for bit. The patches travel as tensors packed back to back (:mod:`.chunks`): a
sparse patch as its int32 (or int64) flat indices then its values, a dense one as its values.

The server keeps the last policy it received in the same checkpoint names (host memory,
:class:`KeptPolicy`), applies the patches to it, checks each patched tensor's :func:`checksum`
against the trainer's, and only then reloads its model from the whole policy through vLLM's
layerwise reload, the path a full push takes: whatever the model's loaders fuse, shard,
quantize or repack, the server ends bit for bit where a full push would put it.

This module needs only torch: the server's side (:mod:`.gloo`) imports vLLM.

Example:
    >>> import torch
    >>> encoder = DeltaEncoder()
    >>> first = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    >>> encoder.remember(first.items())
    >>> second = {"w": first["w"].clone()}
    >>> second["w"][[3, 7]] = 1.0
    >>> patches, stats = encoder.encode(second.items())
    >>> [(p.name, p.indices.tolist(), p.values.tolist()) for p in patches]
    [('w', [3, 7], [1.0, 1.0])]
    >>> stats.changed_elements, stats.sent_bytes
    (2, 12)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch

from asyncgrpo.adapters.transfer.chunks import padded_nbytes
from asyncgrpo.core.weights import delta

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@attrs.frozen(eq=False)
class Patch:
    """One checkpoint tensor's update.

    Attributes:
        name: its checkpoint name (what the server's ``load_weights`` takes).
        shape: its full shape.
        values: 1-D: the new values at ``indices`` (sparse), or the whole tensor flattened
            (dense).
        indices: 1-D int32 (int64 past 2**31 elements) flat indices, ascending; None for a
            dense patch.
        checksum: :func:`checksum` of the whole tensor once patched.
    """

    name: str
    shape: tuple[int, ...]
    values: torch.Tensor
    indices: torch.Tensor | None = None
    checksum: int = 0

    @property
    def count(self) -> int:
        """On the wire: the number of sparse entries, or -1 for a dense patch."""
        return -1 if self.indices is None else self.indices.numel()

    def tensors(self) -> list[torch.Tensor]:
        """What travels, in order: the indices (sparse only), then the values."""
        return [self.values] if self.indices is None else [self.indices, self.values]


def changed_indices(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat indices (ascending, int64) where ``new`` and ``old`` differ bit for bit (NaNs and
    signed zeros compared by their bits, not their values)."""
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(
            f"a tensor changed shape or dtype since the last push ({tuple(old.shape)} "
            f"{old.dtype} -> {tuple(new.shape)} {new.dtype}): push the full policy"
        )
    bits = _BITS[new.dtype.itemsize]
    differs = new.reshape(-1).view(bits) != old.reshape(-1).view(bits)
    return differs.nonzero().reshape(-1)


class KeptPolicy:
    """A policy kept for deltas, each tensor with its :func:`checksum`: the trainer's last push
    (:class:`DeltaEncoder`), or the server's copy of it. The checksums are computed in full
    once, then kept up to date from each patch alone (:func:`checksum_update`): a push costs
    what it changed, not the model's size."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tensors = {name: tensor.detach().clone() for name, tensor in weights}
        self.sums = {name: checksum(tensor) for name, tensor in self.tensors.items()}

    def apply(self, patch: Patch) -> int:
        """Write ``patch`` into the kept tensor of its name in place; its checksum after.

        Raises:
            KeyError: no tensor of that name is kept.
            ValueError: the kept tensor is not the shape the patch is for.
        """
        kept = self.tensors[patch.name]
        if tuple(kept.shape) != patch.shape:
            raise ValueError(
                f"{patch.name}: a patch for shape {patch.shape} but the kept policy holds "
                f"{tuple(kept.shape)}"
            )
        flat = kept.view(-1)
        values = patch.values.to(flat.device, flat.dtype)
        if patch.indices is None:
            flat.copy_(values)
            total = checksum(kept)
        else:
            where = patch.indices.to(flat.device, torch.int64)
            total = checksum_update(self.sums[patch.name], flat[where], values, where)
            flat[where] = values
        self.sums[patch.name] = total
        return total


class DeltaEncoder:
    """The last pushed policy (rank 0), and the patches that bring it to the next one."""

    def __init__(self) -> None:
        self.kept: KeptPolicy | None = None

    @property
    def has_baseline(self) -> bool:
        """Whether a push was remembered (a delta needs one)."""
        return self.kept is not None

    @property
    def previous(self) -> dict[str, torch.Tensor]:
        """The last pushed policy (empty before the first push)."""
        return self.kept.tensors if self.kept is not None else {}

    def remember(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep ``weights`` (a full push) as the baseline of the next delta (copies)."""
        self.kept = KeptPolicy(weights)

    def encode(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> tuple[list[Patch], delta.DeltaStats]:
        """The patches from the baseline to ``weights`` (the whole policy, in the server's
        dtype), and what they hold; the baseline becomes ``weights``.

        Raises:
            ValueError: a tensor the baseline lacks, or that changed shape or dtype (the
                policy is no longer the one pushed: push it in full).
        """
        if self.kept is None:
            raise ValueError("a delta needs a baseline: push the full policy first")
        patches: list[Patch] = []
        stats = delta.DeltaStats()
        for name, tensor in weights:
            old = self.kept.tensors.get(name)
            if old is None:
                raise ValueError(f"{name!r} was not in the last push: push the full policy")
            flat = tensor.detach().reshape(-1)
            where = changed_indices(flat, old.reshape(-1))
            changed, numel = where.numel(), flat.numel()
            kind = delta.patch_kind(changed, numel, flat.element_size())
            stats = stats.add(changed, numel, flat.element_size())
            if kind == delta.UNCHANGED:
                continue
            if kind == delta.SPARSE:
                index_dtype = torch.int32 if delta.index_bytes(numel) == 4 else torch.int64
                patch = Patch(name, tuple(tensor.shape), flat[where], where.to(index_dtype))
            else:
                patch = Patch(name, tuple(tensor.shape), flat.clone())
            patches.append(attrs.evolve(patch, checksum=self.kept.apply(patch)))
        return patches, stats


def wire_metas(
    patches: Sequence[Patch],
) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """Per patch, the tensors it travels as: ``(name, dtype, shape)`` for :func:`.chunks.unpack`."""
    return [[(patch.name, t.dtype, tuple(t.shape)) for t in patch.tensors()] for patch in patches]


def patch_metas(
    name: str, dtype: torch.dtype, shape: Sequence[int], count: int
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The server's side of :func:`wire_metas`: the tensors one patch travels as, from its
    name, dtype, full shape and :attr:`Patch.count`."""
    numel = 1
    for size in shape:
        numel *= size
    if count < 0:
        return [(name, dtype, (numel,))]
    index_dtype = torch.int32 if delta.index_bytes(numel) == 4 else torch.int64
    return [(name, index_dtype, (count,)), (name, dtype, (count,))]


def patch_sizes(metas: Sequence[Sequence[tuple[str, torch.dtype, tuple[int, ...]]]]) -> list[int]:
    """Bytes each patch takes in a chunk (its tensors at their padded sizes): chunks never
    split a patch."""
    return [sum(padded_nbytes(dtype, shape) for _, dtype, shape in tensors) for tensors in metas]


CHECKSUM_CHUNK = 1 << 22
"""Elements summed at once by :func:`checksum` (its int64 working copy: 32 MiB)."""


def checksum(tensor: torch.Tensor) -> int:
    """A checksum of ``tensor``'s bits, computed where it lives (no host copy of a GPU
    tensor): the sum over elements of ``bits * (2 * position + 1)`` in 64-bit integers,
    wrapping. Integer sums do not depend on their order, so the trainer's GPU and the server's
    host get the same number; any one changed element, or two swapped, changes it.

    Example:
        >>> a = torch.tensor([1.0, 2.0, 3.0])
        >>> checksum(a) == checksum(a.clone()), checksum(a) == checksum(a.flip(0))
        (True, False)
    """
    bits = tensor.detach().reshape(-1).view(_BITS[tensor.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), CHECKSUM_CHUNK):
        part = bits[start : start + CHECKSUM_CHUNK].to(torch.int64)
        odd = torch.arange(start, start + part.numel(), device=bits.device) * 2 + 1
        total += (part * odd).sum()
    return int(total)


def checksum_update(total: int, old: torch.Tensor, new: torch.Tensor, indices: torch.Tensor) -> int:
    """:func:`checksum` of a tensor whose elements at flat ``indices`` (distinct) went from
    ``old`` to ``new``, from its checksum ``total`` before: only the changed elements are
    read.

    Example:
        >>> a = torch.tensor([1.0, 2.0, 3.0, 4.0])
        >>> b = a.clone()
        >>> where = torch.tensor([1, 3])
        >>> b[where] = torch.tensor([5.0, -1.0])
        >>> checksum_update(checksum(a), a[where], b[where], where) == checksum(b)
        True
    """
    bits = _BITS[new.element_size()]
    diff = new.reshape(-1).view(bits).to(torch.int64) - old.reshape(-1).view(bits).to(torch.int64)
    odd = indices.to(torch.int64) * 2 + 1
    return _signed64(total + int((diff * odd).sum()))


def _signed64(value: int) -> int:
    """``value`` wrapped into a signed 64-bit integer, as torch's int64 sums wrap."""
    return (value + 2**63) % 2**64 - 2**63
