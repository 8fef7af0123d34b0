"""Whether the learner computes in bf16 (fp32 master weights) or in its weights' own dtype: a
decision over the device, the model's size and what this machine measured.

With ``bf16`` unset (``None``) the learner uses bf16 on CUDA, and on a CPU when both hold:

* the model is large enough that its step is matrix products rather than per-call overhead
  (:data:`BF16_MIN_PARAMETERS`): the 2-layer test models (under 1M parameters) train in fp32
  at 5-10% MFU, where bf16 saves nothing and costs the sampler/trainer parity of fp32; the
  135M-parameter SmolLM2 trains at 30% MFU in fp32 (docs/real_model.md);
* this CPU multiplies bf16 matrices at the model's shapes at least :data:`BF16_MIN_SPEEDUP`
  times faster than fp32 (measured at start: native bf16, as AVX-512 BF16 or AMX give;
  emulated bf16 is slower than fp32).

Example:
    >>> choose_precision(None, on_cuda=False, parameters=134_515_008, matmul_speedup=2.6).bf16
    True
    >>> choose_precision(None, on_cuda=False, parameters=600_000, matmul_speedup=2.6).reason
    'fp32: 0.6M parameters, under the 50M at which bf16 pays on a CPU'
    >>> choose_precision(False, on_cuda=True, parameters=10**9, matmul_speedup=None).bf16
    False
"""

from __future__ import annotations

import attrs

BF16_MIN_PARAMETERS = 50_000_000
BF16_MIN_SPEEDUP = 2.0


@attrs.frozen
class PrecisionChoice:
    """bf16 or not, and why (for the run's log)."""

    bf16: bool
    reason: str


def choose_precision(
    requested: bool | None, on_cuda: bool, parameters: int, matmul_speedup: float | None
) -> PrecisionChoice:
    """The learner's compute precision.

    Args:
        requested: the config's ``bf16`` (None: decide).
        on_cuda: the learner's device is a GPU.
        parameters: the model's parameters.
        matmul_speedup: fp32 over bf16 seconds of a matrix product at the model's shapes on
            this CPU (None: not measured, as for a model under :data:`BF16_MIN_PARAMETERS`).
    """
    if requested is not None:
        return PrecisionChoice(requested, f"bf16={requested} (config)")
    if on_cuda:
        return PrecisionChoice(True, "bf16 on CUDA")
    if parameters < BF16_MIN_PARAMETERS:
        return PrecisionChoice(
            False,
            f"fp32: {parameters / 1e6:.1f}M parameters, under the "
            f"{BF16_MIN_PARAMETERS / 1e6:.0f}M at which bf16 pays on a CPU",
        )
    if matmul_speedup is None or matmul_speedup < BF16_MIN_SPEEDUP:
        measured = "not measured" if matmul_speedup is None else f"{matmul_speedup:.2f}x"
        return PrecisionChoice(
            False,
            f"fp32: bf16 matrix products are {measured} fp32's speed on this CPU "
            f"(bf16 needs {BF16_MIN_SPEEDUP}x)",
        )
    return PrecisionChoice(
        True,
        f"bf16 (fp32 master weights): bf16 matrix products run {matmul_speedup:.2f}x "
        f"faster than fp32 at the model's shapes on this CPU",
    )
