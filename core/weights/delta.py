"""Weight pushes as deltas: what a push sends when only part of the policy changed.

In the server's dtype (bf16 on GPUs) most elements of a weight do not change from one push to
the next: an optimizer step at an RL learning rate moves a weight by less than half a bf16
step, and only the elements whose fp32 master crossed a rounding boundary change. A delta
push sends, per checkpoint tensor, the flat indices and new values of the elements that
changed (a *sparse* patch), the whole tensor where that is cheaper (a *dense* patch), and
nothing for a tensor that did not change. The server applies them to the policy it kept from
the last push, checks each patched tensor's checksum, and reloads its model from it as a full
push does (:mod:`asyncgrpo.adapters.transfer.delta`), so after any number of deltas it holds
bit for bit what a full push would have given it: a delta saves the bytes on the wire, not the
server's reload.

A server gets a delta only when it holds the previous push exactly: the first push of a run,
a server that restarted or reconnected, and a server a push failed on get the full policy
(:func:`gets_delta`).

Example:
    >>> patch_kind(changed=10, numel=1_000, value_bytes=2)
    'sparse'
    >>> patch_kind(changed=400, numel=1_000, value_bytes=2)
    'dense'
    >>> patch_kind(changed=0, numel=1_000, value_bytes=2)
    'unchanged'
"""

from __future__ import annotations

from collections.abc import Collection

import attrs

from asyncgrpo.core.weights.sync import GLOO

SPARSE = "sparse"
DENSE = "dense"
UNCHANGED = "unchanged"

INT32_LIMIT = 2**31 - 1
"""Largest flat index an int32 holds: a tensor with more elements takes int64 indices."""


def index_bytes(numel: int) -> int:
    """Bytes of one flat index into a tensor of ``numel`` elements (int32, or int64 past
    :data:`INT32_LIMIT`).

    Example:
        >>> index_bytes(4096), index_bytes(2**31 + 1)
        (4, 8)
    """
    return 4 if numel - 1 <= INT32_LIMIT else 8


def patch_kind(changed: int, numel: int, value_bytes: int) -> str:
    """How a tensor of ``numel`` elements of ``value_bytes`` bytes each, ``changed`` of which
    differ from the last push, is sent: :data:`UNCHANGED` (nothing), :data:`SPARSE` (an index and
    a value per changed element) when that is fewer bytes than the whole tensor, else
    :data:`DENSE`."""
    if not 0 <= changed <= numel:
        raise ValueError(f"changed elements must be in [0, {numel}], got {changed}")
    if changed == 0:
        return UNCHANGED
    sparse = changed * (index_bytes(numel) + value_bytes)
    return SPARSE if sparse < numel * value_bytes else DENSE


def patch_bytes(changed: int, numel: int, value_bytes: int) -> int:
    """Bytes a tensor's patch carries (:func:`patch_kind` decides which).

    Example:
        >>> patch_bytes(10, 1_000, 2), patch_bytes(900, 1_000, 2), patch_bytes(0, 1_000, 2)
        (60, 2000, 0)
    """
    kind = patch_kind(changed, numel, value_bytes)
    if kind == UNCHANGED:
        return 0
    if kind == SPARSE:
        return changed * (index_bytes(numel) + value_bytes)
    return numel * value_bytes


def gets_delta(server: int, in_sync: Collection[int]) -> bool:
    """Whether ``server`` gets a delta: only a server that holds the previous push exactly
    (``in_sync``: every push to it since it last joined landed) does; any other gets the full
    policy.

    Example:
        >>> gets_delta(0, {0, 1}), gets_delta(2, {0, 1})
        (True, False)
    """
    return server in in_sync


@attrs.frozen
class DeltaStats:
    """What one delta push found and sent (rank 0).

    Attributes:
        tensors: checkpoint tensors in the policy.
        unchanged_tensors: tensors with no changed element (nothing sent).
        elements: elements in the policy.
        changed_elements: elements that differ, bit for bit in the server's dtype, from the
            last push.
        sent_bytes: bytes of the patches (indices and values).
        full_bytes: bytes of a full push of the same policy.
    """

    tensors: int = 0
    unchanged_tensors: int = 0
    elements: int = 0
    changed_elements: int = 0
    sent_bytes: int = 0
    full_bytes: int = 0

    @property
    def unchanged_frac(self) -> float:
        """Fraction of the policy's elements the push did not need to send.

        Example:
            >>> DeltaStats(elements=1_000, changed_elements=25).unchanged_frac
            0.975
        """
        return 1.0 - self.changed_elements / self.elements if self.elements else 1.0

    def add(self, changed: int, numel: int, value_bytes: int) -> DeltaStats:
        """These stats with one more tensor counted.

        Example:
            >>> stats = DeltaStats().add(10, 1_000, 2).add(0, 50, 2)
            >>> stats.unchanged_tensors, stats.changed_elements, stats.sent_bytes, stats.full_bytes
            (1, 10, 60, 2100)
        """
        return DeltaStats(
            tensors=self.tensors + 1,
            unchanged_tensors=self.unchanged_tensors + (changed == 0),
            elements=self.elements + numel,
            changed_elements=self.changed_elements + changed,
            sent_bytes=self.sent_bytes + patch_bytes(changed, numel, value_bytes),
            full_bytes=self.full_bytes + numel * value_bytes,
        )


def delta_push_bytes(full_bytes: float, changed_frac: float, value_bytes: int) -> float:
    """Bytes a delta push of a policy of ``full_bytes`` sends when a fraction ``changed_frac``
    of its elements changed, spread evenly (int32 indices): never more than a full push.

    Example:
        >>> delta_push_bytes(2e9, 0.01, 2)  # 1% of a 1B-parameter bf16 policy changed
        60000000.0
    """
    if not 0.0 <= changed_frac <= 1.0:
        raise ValueError(f"changed_frac must be in [0, 1], got {changed_frac}")
    return min(full_bytes, full_bytes * changed_frac * (4 + value_bytes) / value_bytes)


def delta_refusal(backend: str, is_peft: bool) -> str | None:
    """Why ``weight_sync_delta=True`` cannot run, or None: it needs the ``asyncgrpo_gloo``
    engine (the disk and NCCL paths send every weight) and merged weights (a PEFT model pushes
    its adapter).

    Example:
        >>> delta_refusal("asyncgrpo_gloo", is_peft=False) is None
        True
        >>> print(delta_refusal("disk", is_peft=False))  # doctest: +ELLIPSIS
        AsyncGRPOConfig.weight_sync_delta=True needs weight_transfer_backend='asyncgrpo_gloo' ...
    """
    fix = "or set weight_sync_delta=False"
    if backend != GLOO:
        return (
            f"AsyncGRPOConfig.weight_sync_delta=True needs weight_transfer_backend={GLOO!r} "
            f'(a server started with --weight-transfer-config \'{{"backend": "{GLOO}"}}\'); '
            f"the run's weights take the {backend} path, which sends every weight: start the "
            f"server with that engine, {fix}"
        )
    if is_peft:
        return (
            "AsyncGRPOConfig.weight_sync_delta=True: a PEFT model pushes its adapter, not its "
            f"merged weights; train without peft_config, {fix}"
        )
    return None
