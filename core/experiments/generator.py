"""The generator's part model: one vLLM server decoding requests with continuous batching.

Each request has its own prompt and response length. A decode step advances every *running*
request by one token and takes

    memory_s  = weight_read_s + context_read_s_per_token x (KV tokens of the running requests)
    compute_s = compute_s_per_request x (running requests)
    step_s    = overhead_s + max(memory_s, compute_s)     (``roofline``: the two overlap)
              = overhead_s + memory_s + compute_s         (otherwise)

so throughput, ``running / step_s`` tokens per second, grows with the requests in flight
until compute or the KV reads bound it. A request runs when its KV cache fits: requests are
admitted in arrival order while their tokens (prompt and generated so far) fit
``kv_capacity_tokens``; the rest wait, as vLLM's scheduler makes them. A group's prompt is
prefilled once (prefix caching) at ``prefill_tokens_per_s``, server time taken from decoding.

Where the numbers come from, always stated in :attr:`Generator.source`:

* :func:`constant`: one fitted throughput shared by the requests in flight (a calibration run
  at one concurrency; ``asyncgrpo simulate``'s ``generation_tokens_per_s``);
* :func:`fit_concurrency`: ``step_s = a + b x requests`` fitted to windows at several
  concurrencies (``rollout/concurrency``, ``rollout/generated_tokens_per_s``);
* :func:`roofline`: a GPU's data-sheet bandwidth and FLOP/s (an upper bound, labelled so);
* :func:`scaled_to`: a roofline scaled so that it gives a published (or measured) decode
  figure at the concurrency it was taken at.

Example:
    >>> from asyncgrpo.core.experiments.hardware import GPUS, parameters_only
    >>> g = roofline(GPUS["h100"], parameters_only(7e9, kv_bytes_per_token=57344), 1)
    >>> [round(g.tokens_per_s(c, c * 2000)) for c in (1, 64, 256)]  # 2,000 KV tokens each
    [237, 10047, 19779]
    >>> round(g.kv_capacity_tokens)  # what fits beside the weights at 90% of 80 GB
    976562
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

from asyncgrpo.core.experiments.hardware import GPU, ModelSpec

GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization``: the share of a GPU for weights and KV cache."""
ACTIVATION_RESERVE_BYTES = 2e9
"""Per GPU, kept from the KV cache for activations and CUDA graphs (an assumption)."""
DECODE_STEP_OVERHEAD_S = 5.18e-3
"""Seconds every decode step takes besides the roofline (kernel launches, the tensor-parallel
all-reduces, sampling, the scheduler), the planner's default: fitted to verl's fully
asynchronous recipe's colocated synchronous run of Qwen2.5-Math-7B on 128 H20 GPUs (vLLM at
tensor-parallel 4), whose generation phase, 177.85 s a step, waits for its longest response
decoded one token a step (``recipe/fully_async_policy/README.md``, 2025-12-25;
docs/experiments.md, "Checked against published runs"). One run's figure, assumed for every
GPU and model size."""
DECODE_MFU = 0.5
PREFILL_MFU = 0.6


@attrs.frozen
class Generator:
    """One server's decode step and prefill (the module's docstring).

    Attributes:
        compute_s_per_request: seconds of a decode step per running request.
        weight_read_s: seconds of a decode step reading the weights.
        context_read_s_per_token: seconds of a decode step per KV token of running requests.
        overhead_s: seconds of every decode step besides (scheduling, sampling).
        roofline: memory and compute overlap (max) rather than add up.
        kv_capacity_tokens: KV-cache tokens of the server (``inf``: unbounded).
        prefill_tokens_per_s: prompt tokens prefilled per second (``inf``: free).
        source: where the figures come from.
    """

    compute_s_per_request: float
    weight_read_s: float = 0.0
    context_read_s_per_token: float = 0.0
    overhead_s: float = 0.0
    roofline: bool = False
    kv_capacity_tokens: float = math.inf
    prefill_tokens_per_s: float = math.inf
    source: str = "given"

    def __attrs_post_init__(self) -> None:
        costs = (
            self.compute_s_per_request,
            self.weight_read_s,
            self.context_read_s_per_token,
            self.overhead_s,
        )
        if min(costs) < 0 or self.compute_s_per_request + self.weight_read_s <= 0:
            raise ValueError(
                f"a generator's step costs are >= 0 and it takes time per step or "
                f"per request, got {costs}"
            )
        if not (self.kv_capacity_tokens > 0 and self.prefill_tokens_per_s > 0):
            raise ValueError("a generator's KV capacity and prefill speed must be > 0")

    def step_s(self, requests: float, context_tokens: float) -> float:
        """Seconds of one decode step of ``requests`` running requests holding
        ``context_tokens`` KV tokens together."""
        return float(self.step_s_of(np.asarray(requests), np.asarray(context_tokens)))

    def step_s_of(self, requests: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        """:meth:`step_s` of several servers at once (one entry per server)."""
        memory = self.weight_read_s + self.context_read_s_per_token * context_tokens
        compute = self.compute_s_per_request * requests
        both = np.maximum(memory, compute) if self.roofline else memory + compute
        return self.overhead_s + both

    def tokens_per_s(self, requests: float, context_tokens: float = 0.0) -> float:
        """Decoded tokens per second with ``requests`` running (0 with none)."""
        return requests / self.step_s(requests, context_tokens) if requests > 0 else 0.0

    def prefill_s(self, prompt_tokens: float) -> float:
        """Seconds to prefill ``prompt_tokens``."""
        return prompt_tokens / self.prefill_tokens_per_s


def constant(tokens_per_s: float, source: str = "one fitted throughput") -> Generator:
    """``tokens_per_s`` however many requests run: a step of ``c`` requests takes ``c /
    tokens_per_s``.

    Example:
        >>> g = constant(4500.0)
        >>> g.tokens_per_s(1), g.tokens_per_s(300)
        (4500.0, 4500.0)
    """
    if not tokens_per_s > 0:
        raise ValueError(f"a generator's throughput must be > 0, got {tokens_per_s}")
    return Generator(compute_s_per_request=1.0 / tokens_per_s, source=source)


def fit_concurrency(
    points: Sequence[tuple[float, float]], source: str = "fitted to concurrency"
) -> Generator:
    """``step_s = a + b x requests`` fitted to ``(requests, tokens_per_s)`` points: each gives
    ``requests / tokens_per_s = a + b x requests``, a straight line fitted by least squares
    (``a`` kept >= 0; one concurrency alone gives :func:`constant`).

    Example:
        >>> points = [(c, c / (0.01 + 0.0002 * c)) for c in (4, 16, 64)]
        >>> g = fit_concurrency(points)
        >>> round(g.weight_read_s, 4), round(g.compute_s_per_request, 6)
        (0.01, 0.0002)
    """
    usable = [(c, t) for c, t in points if c > 0 and t > 0]
    if not usable:
        raise ValueError("no (requests, tokens_per_s) point with both > 0 to fit")
    requests = np.array([c for c, _ in usable])
    step = requests / np.array([t for _, t in usable])
    if np.ptp(requests) < 1e-9 * max(requests.max(), 1.0):
        return constant(float(np.sum(requests) / np.sum(step)), source)
    slope, intercept = np.polyfit(requests, step, 1)
    if intercept < 0 or slope <= 0:  # no fixed cost (or no per-request cost) in the data
        if slope > 0:  # through the origin
            per_request = float(np.sum(step * requests) / np.sum(requests**2))
            return Generator(compute_s_per_request=per_request, source=source)
        return Generator(
            compute_s_per_request=0.0, weight_read_s=float(np.mean(step)), source=source
        )
    return Generator(
        compute_s_per_request=float(slope), weight_read_s=float(intercept), source=source
    )


def kv_capacity_tokens(
    gpu: GPU,
    model: ModelSpec,
    tensor_parallel: int,
    memory_utilization: float = GPU_MEMORY_UTILIZATION,
) -> float:
    """KV-cache tokens of a server on ``tensor_parallel`` GPUs: what is left of each GPU's
    share after its slice of the weights and the activation reserve, over the KV bytes per
    token (0 when the weights do not fit; ``inf`` when the model's KV bytes are unknown)."""
    free = tensor_parallel * (gpu.memory_bytes * memory_utilization - ACTIVATION_RESERVE_BYTES)
    free -= model.weight_bytes
    if model.kv_bytes_per_token is None:
        return math.inf if free > 0 else 0.0
    return max(free, 0.0) / model.kv_bytes_per_token


def roofline(
    gpu: GPU,
    model: ModelSpec,
    tensor_parallel: int,
    decode_mfu: float = DECODE_MFU,
    prefill_mfu: float = PREFILL_MFU,
    memory_utilization: float = GPU_MEMORY_UTILIZATION,
) -> Generator:
    """A server of ``tensor_parallel`` GPUs from the data sheet: a decode step reads the
    weights and the running requests' KV cache at the GPUs' bandwidth, or computes
    ``flops_per_token`` per request at ``decode_mfu`` of their peak, whichever is slower;
    prefill at ``prefill_mfu``. An upper bound: no communication between the tensor-parallel
    ranks, no scheduling overhead.

    Raises:
        ValueError: the weights do not fit the servers' GPUs (naming what would).
    """
    if kv_capacity_tokens(gpu, model, tensor_parallel, memory_utilization) <= 0:
        raise ValueError(
            f"{model.weight_bytes / 1e9:.0f} GB of bf16 weights do not fit "
            f"{tensor_parallel} {gpu.name} GPU(s) beside a KV cache: raise the "
            "tensor-parallel size"
        )
    bandwidth = tensor_parallel * gpu.memory_bytes_per_s
    flops = tensor_parallel * gpu.bf16_flops
    return Generator(
        compute_s_per_request=model.flops_per_token / (decode_mfu * flops),
        weight_read_s=model.weight_bytes / bandwidth,
        context_read_s_per_token=(model.kv_bytes_per_token or 0.0) / bandwidth,
        roofline=True,
        kv_capacity_tokens=kv_capacity_tokens(gpu, model, tensor_parallel, memory_utilization),
        prefill_tokens_per_s=prefill_mfu * flops / model.flops_per_token,
        source=(
            f"ROOFLINE of {tensor_parallel} {gpu.name} (data sheet: "
            f"{gpu.memory_bytes_per_s / 1e12:.2f} TB/s, {gpu.bf16_flops / 1e12:.0f} TFLOP/s "
            f"bf16, decode at {decode_mfu:.0%} of peak): an upper bound, not measured"
        ),
    )


def scaled_to(
    generator: Generator, tokens_per_s: float, requests: float, context_tokens: float, source: str
) -> Generator:
    """``generator`` with every step cost scaled so that ``requests`` running requests
    holding ``context_tokens`` decode ``tokens_per_s`` (a published or measured figure);
    prefill scaled alike.

    Example:
        >>> g = scaled_to(constant(1000.0), 600.0, 8, 0.0, "measured")
        >>> round(g.tokens_per_s(8)), g.source
        (600, 'measured')
    """
    if not (tokens_per_s > 0 and requests > 0):
        raise ValueError("a decode figure needs tokens_per_s > 0 at requests > 0")
    factor = generator.tokens_per_s(requests, context_tokens) / tokens_per_s
    return attrs.evolve(
        generator,
        compute_s_per_request=generator.compute_s_per_request * factor,
        weight_read_s=generator.weight_read_s * factor,
        context_read_s_per_token=generator.context_read_s_per_token * factor,
        overhead_s=generator.overhead_s * factor,
        prefill_tokens_per_s=generator.prefill_tokens_per_s / factor,
        source=source,
    )


def in_units(generator: Generator, unit: float) -> Generator:
    """``generator`` counting ``unit`` tokens as one (a simulation of long responses in fewer
    tokens): a decode step of one unit takes ``unit`` steps, a unit of KV cache is ``unit``
    tokens, so the seconds of a response are unchanged.

    Example:
        >>> g = Generator(0.001, weight_read_s=0.01, context_read_s_per_token=1e-6,
        ...               kv_capacity_tokens=1e5, prefill_tokens_per_s=1e4)
        >>> coarse = in_units(g, 10)
        >>> g.step_s(8, 8000) * 10 == coarse.step_s(8, 800), coarse.kv_capacity_tokens
        (True, 10000.0)
    """
    if unit <= 0:
        raise ValueError(f"a token unit is > 0, got {unit}")
    return attrs.evolve(
        generator,
        compute_s_per_request=generator.compute_s_per_request * unit,
        weight_read_s=generator.weight_read_s * unit,
        context_read_s_per_token=generator.context_read_s_per_token * unit * unit,
        overhead_s=generator.overhead_s * unit,
        kv_capacity_tokens=generator.kv_capacity_tokens / unit,
        prefill_tokens_per_s=generator.prefill_tokens_per_s / unit,
    )


def advance_servers(
    generator: Generator,
    generated: np.ndarray,
    lengths: np.ndarray,
    prompts: np.ndarray,
    servers: np.ndarray,
    seconds: np.ndarray,
) -> np.ndarray:
    """Tokens generated by each request after its server's ``seconds`` more of decoding, every
    server in one pass. Per request, in arrival order: tokens generated so far, response
    length, prompt tokens and its server (an index into ``seconds``, one entry per server).

    A server runs its unfinished requests in arrival order while their KV tokens (prompt and
    generated so far) fit ``kv_capacity_tokens``; the first always runs (vLLM never leaves the
    cache idle with a request waiting), and a later short request does not jump a waiting long
    one. Each running request advances ``seconds / step_s`` tokens, none past its length; the
    step time is taken at the start of the interval, so keep it short against a response's.

    Example:
        >>> g = constant(100.0)  # 100 tokens/s per server, shared by its running requests
        >>> advance_servers(g, np.zeros(3), np.array([10, 50, 50]), np.zeros(3),
        ...                 np.array([0, 0, 1]), np.array([0.5, 0.25])).tolist()
        [10.0, 25.0, 25.0]
        >>> small = Generator(compute_s_per_request=0.01, kv_capacity_tokens=100)
        >>> after = advance_servers(small, np.zeros(4), np.full(4, 9.0),
        ...                         np.array([40.0, 50.0, 20.0, 5.0]), np.zeros(4, int),
        ...                         np.array([0.02]))
        >>> (after > 0).tolist()  # 40 + 50 fit; 20 waits, and 5 waits behind it
        [True, True, False, False]
    """
    active = generated < lengths
    context_tokens = prompts + generated
    if generator.kv_capacity_tokens == math.inf:
        runs = active
    else:
        runs = np.zeros_like(active)
        waiting = np.flatnonzero(active)
        # the active requests grouped by server, arrival order kept within each
        order = waiting[np.argsort(servers[waiting], kind="stable")]
        on = servers[order]
        first = np.ones(len(order), bool)
        first[1:] = on[1:] != on[:-1]
        segment = np.cumsum(first) - 1
        starts = np.flatnonzero(first)
        totals = np.cumsum(context_tokens[order])
        before = (totals - context_tokens[order])[starts]
        fits = totals - before[segment] <= generator.kv_capacity_tokens
        fits[starts] = True  # the first request of a server always runs
        # admitted in order: a request runs when none before it on its server was refused
        refused = np.cumsum(~fits)
        refused_before = (refused - ~fits)[starts]
        runs[order[refused - refused_before[segment] == 0]] = True
    count = np.bincount(servers[runs], minlength=len(seconds))
    context: np.ndarray = np.zeros(len(seconds))
    if generator.context_read_s_per_token:
        context = np.bincount(servers[runs], context_tokens[runs], minlength=len(seconds))
    step = generator.step_s_of(count.astype(float), context)
    per_token = np.divide(seconds, step, out=np.zeros(len(seconds)), where=count > 0)
    advancing = runs & (seconds[servers] > 0)
    return np.where(advancing, np.minimum(generated + per_token[servers], lengths), generated)
