"""Published decode figures per GPU kind and model size, and the decode step overhead each
implies: what the planner adds to the roofline when the workload brings no figure of its own.

A figure is a published time per output token (TPOT) of vLLM serving a bf16 model at a stated
number of requests in flight: one decode step at that concurrency. Against the roofline of the
same GPU and model (:func:`~asyncgrpo.core.experiments.generator.roofline`: the weights and the
running requests' KV cache read at the data sheet's bandwidth), the rest of the step is its
overhead: kernel launches, sampling, the scheduler (:func:`implied_overhead_s`). The planner
takes the figure of the workload's GPU kind nearest its model's size (:func:`nearest`); for a
GPU kind with none,
:data:`~asyncgrpo.core.experiments.generator.DECODE_STEP_OVERHEAD_S` (verl's runs on H20).

Example:
    >>> figure = nearest("h100", 1.5e9)
    >>> figure.model, round(implied_overhead_s(figure) * 1e3, 2)
    ('Mistral-7B-Instruct-v0.3', 4.47)
    >>> nearest("b200", 1.5e9) is None  # no published figure: the default
    True
"""

from __future__ import annotations

import math

import attrs

from asyncgrpo.core.experiments.generator import DECODE_STEP_OVERHEAD_S, roofline
from asyncgrpo.core.experiments.hardware import GPUS, parameters_only


@attrs.frozen
class PublishedDecode:
    """One published decode figure.

    Attributes:
        gpu: the GPU kind (a key of :data:`~asyncgrpo.core.experiments.hardware.GPUS`).
        model: the served model's name; ``parameters`` its weights and
            ``kv_bytes_per_token`` its bf16 KV cache per token over all layers.
        concurrency: requests in flight when it was measured.
        context_tokens: KV tokens each request held on average (its prompt and half its
            output, where the source gives the lengths; else as stated in ``source``).
        tpot_s: the published time per output token, seconds: one decode step.
        source: where it was published, with its date and setup.
    """

    gpu: str
    model: str
    parameters: float
    kv_bytes_per_token: float
    concurrency: float
    context_tokens: float
    tpot_s: float
    source: str


PUBLISHED: tuple[PublishedDecode, ...] = (
    PublishedDecode(
        "a100",
        "Qwen3-1.7B",
        1.72e9,
        114_688,  # 28 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes
        concurrency=1,
        context_tokens=192,  # 128 prompt tokens, 128 output
        tpot_s=4.6e-3,
        source="vLLM on 1 A100-80GB, 128/128 tokens at 1 request: TPOT 4.6 ms "
        "(tenstorrent/tt-inference-server issue 340, 2025-06-24)",
    ),
    PublishedDecode(
        "a100",
        "Mistral-7B-Instruct-v0.3",
        7.25e9,
        131_072,  # 32 layers x 8 KV heads x 128 x 2 x 2 bytes
        concurrency=10,
        context_tokens=400,  # ShareGPT prompts and replies: an assumed mean in flight
        tpot_s=12.11e-3,
        source="vLLM on 1 A100-80GB SXM, 10 ShareGPT prompts at once: mean TPOT 12.11 ms "
        "(LambdaLabsML/vllm-benchmark, results/prompt_10, 2024-09)",
    ),
    PublishedDecode(
        "h100",
        "Mistral-7B-Instruct-v0.3",
        7.25e9,
        131_072,
        concurrency=10,
        context_tokens=400,
        tpot_s=8.95e-3,
        source="vLLM 0.5.4 on 1 H100-80GB SXM, 10 ShareGPT prompts at once: mean TPOT "
        "8.95 ms (LambdaLabsML/vllm-benchmark, results/prompt_10, 2024-08)",
    ),
)
"""The figures found with their setup stated (a survey of 2026-12-07: docs/experiments.md,
"How it predicts"): bf16 vLLM at a known concurrency on one GPU. None was found for H200, H20,
B200 or L40S, nor for dense models past 8B in bf16 with the setup stated."""


def implied_overhead_s(figure: PublishedDecode) -> float:
    """Seconds of the figure's decode step beyond its roofline (at least 0)."""
    server = roofline(
        GPUS[figure.gpu], parameters_only(figure.parameters, figure.kv_bytes_per_token), 1
    )
    step = server.step_s(figure.concurrency, figure.concurrency * figure.context_tokens)
    return max(0.0, figure.tpot_s - step)


def nearest(gpu: str, parameters: float) -> PublishedDecode | None:
    """The published figure of ``gpu`` whose model is nearest ``parameters`` in ratio; None
    where no figure of that GPU kind was found."""
    figures = [f for f in PUBLISHED if f.gpu == gpu]
    if not figures:
        return None
    return min(figures, key=lambda f: abs(math.log(f.parameters / parameters)))


def default_overhead(gpu: str, parameters: float) -> tuple[float, str]:
    """The decode step overhead, seconds, of a workload that gives none, and where it comes
    from: the one the figure :func:`nearest` its model on its GPU kind implies, else
    :data:`~asyncgrpo.core.experiments.generator.DECODE_STEP_OVERHEAD_S` (verl's runs on H20).

    Example:
        >>> seconds, source = default_overhead("b200", 7e9)
        >>> seconds, source.startswith("fitted to verl's published runs on H20")
        (0.00518, True)
    """
    roofline_alone = "[generator] step_overhead_s = 0 for the roofline alone"
    figure = nearest(gpu, parameters)
    if figure is None:
        return DECODE_STEP_OVERHEAD_S, (
            f"fitted to verl's published runs on H20 (the default where no figure of {gpu} "
            f"was found; {roofline_alone})"
        )
    return implied_overhead_s(figure), (
        f"implied by a published figure of the nearest model on {gpu}, {figure.model}: "
        f"{figure.source} ({roofline_alone})"
    )
