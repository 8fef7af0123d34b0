"""The GPU splits ``asyncgrpo plan --workload FILE --gpus N`` weighs, and the part models of
each (:mod:`.generator`, :mod:`.parts`) from the workload alone.

A **split** gives ``trainer_gpus`` to the trainer (FSDP2, one rank per GPU) and the rest to
``servers`` vLLM servers of ``tensor_parallel`` GPUs each. Where they go (:func:`layout`): the
trainer takes the first GPUs, whole nodes when it spans several (torchrun starts the same
number of ranks on every node), and the servers fill each node's remaining GPUs, a server
never straddling two nodes. A split is *feasible* when no GPU is left over, the trainer's
shard of the training state and its activations fit its GPUs
(:func:`~asyncgrpo.core.experiments.parts.trainer_memory_bytes`), and a server's GPUs hold
the weights and a KV cache for at least one group in flight
(:func:`~asyncgrpo.core.experiments.generator.kv_capacity_tokens`). Tensor parallelism is the
smallest size that fits, or twice it (fewer, larger servers: more KV cache each).

**The step** (:func:`step_shape`): rows of ``token_budget`` tokens (at least a whole sample,
the servers' ``--max-model-len``), ``gradient_accumulation_steps`` of them per trainer GPU,
enough that a step holds about ``prompts_per_step x num_generations`` samples.

:func:`screen` estimates each split's samples per second from the parts' steady rates (the
generator full, the trainer busy): cheap, to choose which splits to simulate; the simulation
(``asyncgrpo.shell.experiments``) decides.

Example:
    >>> from asyncgrpo.core.experiments.workload import workload_from_mapping
    >>> w = workload_from_mapping({
    ...     "model": {"name": "m", "parameters": 7e9, "kv_bytes_per_token": 57344},
    ...     "cluster": {"gpu": "h100"}, "batch": {"prompts_per_step": 64, "num_generations": 8},
    ...     "lengths": {"prompt": 512, "response": {"mean": 3000, "p50": 2000, "max": 8192}}})
    >>> [s.label() for s in splits(w, 8)][:3]  # 1 GPU cannot hold 7B's fp32 Adam state
    ['trainer 2 GPU(s), 6 server(s) x TP 1', 'trainer 2 GPU(s), 3 server(s) x TP 2', \
'trainer 3 GPU(s), 5 server(s) x TP 1']
    >>> round(screen(w, Split(5, 3, 1)).generation, 1)  # samples/s, roofline + 4.47 ms a step
    12.9
    >>> layout(Split(4, 2, 2), 8, gpus_per_node=8)
    Layout(trainer=((0, (0, 1, 2, 3)),), servers=((0, (4, 5)), (0, (6, 7))))
"""

from __future__ import annotations

import math

import attrs

from asyncgrpo.core.experiments import generator as generators
from asyncgrpo.core.experiments.parts import (
    Push,
    Trainer,
    fit_trainer,
    fsdp_trainer,
    trainer_memory_bytes,
    weight_push,
)
from asyncgrpo.core.experiments.workload import Workload

PACKING = 0.9
"""The share of a row's ``token_budget`` the planner fills on average (an assumption)."""
MIN_TOKEN_BUDGET = 16384
MAX_REQUESTS_PER_SERVER = 1024
"""At most this many requests in flight per server (vLLM's scheduler bound at its largest)."""
TRAINER_MEMORY_SHARE = 0.85


@attrs.frozen
class Split:
    """GPUs to the trainer, and the servers of ``tensor_parallel`` GPUs each."""

    trainer_gpus: int
    servers: int
    tensor_parallel: int

    @property
    def server_gpus(self) -> int:
        return self.servers * self.tensor_parallel

    def label(self) -> str:
        return (
            f"trainer {self.trainer_gpus} GPU(s), {self.servers} server(s) x TP "
            f"{self.tensor_parallel}"
        )


@attrs.frozen
class Layout:
    """Where each role runs: the trainer's ``(node, devices)`` per node it uses, and each
    server's ``(node, devices)``; devices are numbered within their node."""

    trainer: tuple[tuple[int, tuple[int, ...]], ...]
    servers: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def nodes(self) -> int:
        return 1 + max(node for node, _ in (*self.trainer, *self.servers))


def layout(split: Split, gpus: int, gpus_per_node: int) -> Layout | None:
    """Where ``split``'s roles go on ``gpus`` GPUs (the module's docstring), or None when they
    do not fit that way (a trainer over several nodes but not whole ones, a GPU left over, a
    server straddling nodes)."""
    if split.trainer_gpus + split.server_gpus != gpus or split.tensor_parallel > gpus_per_node:
        return None
    if split.trainer_gpus > gpus_per_node and split.trainer_gpus % gpus_per_node:
        return None
    free = [
        list(range(min(gpus_per_node, gpus - n * gpus_per_node)))
        for n in range(math.ceil(gpus / gpus_per_node))
    ]
    trainer, left = [], split.trainer_gpus
    for node, devices in enumerate(free):
        take = min(left, len(devices))
        if take:
            trainer.append((node, tuple(devices[:take])))
            del devices[:take]
            left -= take
    servers = []
    for node, devices in enumerate(free):
        if len(devices) % split.tensor_parallel:
            return None
        for start in range(0, len(devices), split.tensor_parallel):
            servers.append((node, tuple(devices[start : start + split.tensor_parallel])))
    return Layout(tuple(trainer), tuple(servers))


def colocated_layout(split: Split, gpus_per_node: int) -> Layout:
    """Trainer and servers on the same GPUs (each GPU generates, then trains): the trainer on
    every one of ``split.trainer_gpus``, the servers tiling them node by node.

    Example:
        >>> colocated_layout(Split(16, 4, 4), 8).servers[-1]
        (1, (4, 5, 6, 7))
    """
    gpus = split.trainer_gpus
    nodes = tuple(
        (n, tuple(range(min(gpus_per_node, gpus - n * gpus_per_node))))
        for n in range(math.ceil(gpus / gpus_per_node))
    )
    tp = split.tensor_parallel
    servers = tuple(
        (n, devices[i : i + tp])
        for n, devices in nodes
        for i in range(0, len(devices) - tp + 1, tp)
    )
    return Layout(nodes, servers)


@attrs.frozen
class StepShape:
    """The step's settings: rows of ``token_budget`` tokens, ``gradient_accumulation_steps``
    per trainer GPU; ``max_concurrent_rollouts`` over all servers; the forwarded tokens a
    step is expected to hold."""

    token_budget: int
    gradient_accumulation_steps: int
    max_concurrent_rollouts: int
    forwarded_tokens: float


def step_tokens(workload: Workload) -> float:
    """Forwarded tokens of a step: each prompt once (a group's prompt is shared in its row)
    and every response."""
    return workload.prompts_per_step * (
        workload.prompt_lengths.mean + workload.num_generations * workload.response_lengths.mean
    )


def token_budget(workload: Workload) -> int:
    """A row's tokens: the longest sample at least, and at least :data:`MIN_TOKEN_BUDGET`,
    rounded up to 1,024."""
    return 1024 * math.ceil(max(workload.max_model_len, MIN_TOKEN_BUDGET) / 1024)


def step_shape(workload: Workload, split: Split) -> StepShape:
    """The step's settings for ``split`` (the module's docstring)."""
    budget = token_budget(workload)
    rows = step_tokens(workload) / (PACKING * budget)
    accumulation = max(1, math.ceil(rows / split.trainer_gpus - 1e-9))
    # a group holds its slots until its longest response ends: enough slots that the KV
    # cache stays full of running requests
    slots = server_concurrency(workload, split) / running_share(workload)
    per_server = min(MAX_REQUESTS_PER_SERVER, int(slots))
    groups = max(1, split.servers * per_server // workload.num_generations)
    return StepShape(budget, accumulation, groups * workload.num_generations, step_tokens(workload))


def running_share(workload: Workload) -> float:
    """The share of a group's requests still running while the group is in flight: its mean
    response over its longest (a group holds its slots until its longest ends)."""
    responses = workload.response_lengths
    return responses.mean / responses.expected_longest(workload.num_generations)


def in_flight_tokens(workload: Workload) -> float:
    """KV tokens a request holds on average while in flight (prompt and the length-biased
    half of its response)."""
    return workload.response_lengths.in_flight_tokens(workload.prompt_lengths.mean)


def server_generator(workload: Workload, tensor_parallel: int) -> generators.Generator:
    """A server's part model: the roofline of its GPUs with the workload's decode step
    overhead (:attr:`Workload.decode_overhead_s`), scaled to the workload's decode figure when
    it gives one (a figure per GPU, at ``concurrency`` requests per GPU)."""
    roofline = generators.roofline(workload.gpu, workload.model, tensor_parallel)
    overhead = workload.decode_overhead_s
    if overhead:
        roofline = attrs.evolve(
            roofline,
            overhead_s=overhead,
            source=f"{roofline.source}; {overhead * 1e3:.3g} ms a decode step besides, "
            f"{workload.decode_overhead_source}",
        )
    figure = workload.decode_figure
    if figure is None:
        return roofline
    context = (
        figure.context_tokens if figure.context_tokens is not None else (in_flight_tokens(workload))
    )
    requests = figure.concurrency * tensor_parallel
    return generators.scaled_to(
        roofline,
        figure.tokens_per_s * tensor_parallel,
        requests,
        requests * context,
        f"the roofline of {tensor_parallel} {workload.gpu.name} scaled to {figure.tokens_per_s:g} "
        f"tokens/s per GPU at {figure.concurrency:g} requests ({figure.source})",
    )


def server_concurrency(workload: Workload, split: Split) -> int:
    """Requests one server holds in its KV cache at the workload's mean footprint."""
    capacity = generators.kv_capacity_tokens(workload.gpu, workload.model, split.tensor_parallel)
    if capacity == math.inf:
        return MAX_REQUESTS_PER_SERVER
    return int(capacity / in_flight_tokens(workload))


def trainer_part(workload: Workload, split: Split, shape: StepShape) -> Trainer:
    """The trainer's part model: the fit of the workload's measured steps
    (:func:`~asyncgrpo.core.experiments.parts.fit_trainer`), else its FLOPs per token with
    attention over the mean sample (``2 x layers x heads x head_dim`` per key a token attends,
    half the sample causally) and the seconds a step no number of GPUs removes
    (:attr:`Workload.trainer_overhead_s`)."""
    if workload.train_measured:
        fit = fit_trainer(workload.train_measured)
        gpus = ", ".join(str(g) for g, _ in workload.train_measured)
        return Trainer(
            tokens_per_s=shape.forwarded_tokens * split.trainer_gpus / fit.gpu_s,
            fixed_s=fit.fixed_s,
            gpus=split.trainer_gpus,
            source=(
                f"FITTED to the workload's measured steps on {gpus} trainer GPUs: "
                f"{fit.fixed_s:.1f} s + {fit.gpu_s:,.0f} GPU-s / GPUs"
            ),
        )
    model = workload.model
    if model.shape is not None:
        sample = workload.prompt_lengths.mean + workload.response_lengths.mean
        s = model.shape
        attention = 2.0 * s.layers * s.heads * s.head_dim * sample
        model = attrs.evolve(model, flops_per_token=model.flops_per_token + attention)
    return fsdp_trainer(
        model,
        workload.gpu,
        split.trainer_gpus,
        workload.intra_node,
        workload.inter_node,
        workload.gpus_per_node,
        micro_batch_tokens=PACKING * shape.token_budget,
        micro_batches=shape.gradient_accumulation_steps,
        mfu=workload.train_mfu,
        step_overhead_s=workload.trainer_overhead_s,
    )


def push_part(workload: Workload, split: Split, where: Layout, colocated: bool = False) -> Push:
    """The push of the workload's weight path: over NVLink when every server shares the
    trainer's first node, else over the link between nodes. ``colocated``: each server's GPUs
    hold the trainer's shards of the weights, so every server gathers its copy at once, over
    NVLink (one transfer's time)."""
    if colocated:
        link = workload.intra_node
        return weight_push(
            workload.model,
            workload.weight_path,
            1,
            split.trainer_gpus,
            link,
            link,
            workload.lora_bytes,
            workload.delta_changed_frac,
        )
    first = where.trainer[0][0]
    local = all(node == first for node, _ in where.servers)
    return weight_push(
        workload.model,
        workload.weight_path,
        split.servers,
        split.trainer_gpus,
        workload.intra_node,
        workload.intra_node if local else workload.inter_node,
        workload.lora_bytes,
        workload.delta_changed_frac,
    )


def fits(workload: Workload, split: Split) -> bool:
    """Whether the trainer's GPUs hold its state and a row, and a server's GPUs the weights
    and a KV cache for a whole group."""
    memory = trainer_memory_bytes(workload.model, split.trainer_gpus, token_budget(workload))
    if memory > TRAINER_MEMORY_SHARE * workload.gpu.memory_bytes:
        return False
    return server_concurrency(workload, split) >= workload.num_generations


def splits(workload: Workload, gpus: int) -> tuple[Split, ...]:
    """Every feasible split of ``gpus`` (the module's docstring), fewest trainer GPUs first.

    Raises:
        ValueError: none is feasible, naming why (too few GPUs for the trainer's state or a
            server's weights).
    """
    sizes = [tp for tp in (1, 2, 4, 8, 16) if tp <= workload.gpus_per_node]
    smallest = next(
        (tp for tp in sizes if generators.kv_capacity_tokens(workload.gpu, workload.model, tp) > 0),
        None,
    )
    if smallest is None:
        raise ValueError(
            f"the model's bf16 weights ({workload.model.weight_bytes / 1e9:.0f} GB) "
            f"do not fit one node's {workload.gpus_per_node} {workload.gpu.name} "
            "GPUs; this planner places a server within a node"
        )
    found = []
    for trainer in range(1, gpus):
        for tp in (smallest, 2 * smallest):
            if tp not in sizes or (gpus - trainer) % tp:
                continue
            split = Split(trainer, (gpus - trainer) // tp, tp)
            if layout(split, gpus, workload.gpus_per_node) and fits(workload, split):
                found.append(split)
    if not found:
        raise ValueError(
            f"no split of {gpus} {workload.gpu.name} GPUs fits: the trainer's "
            f"fp32 state needs {trainer_memory_bytes(workload.model, 1, 0) / 1e9:.0f}"
            " GB over its GPUs and each server its weights and a group's KV "
            "cache; plan for more GPUs"
        )
    return tuple(found)


@attrs.frozen
class Estimate:
    """A split's steady rates, samples per second: the generator with every server full, the
    trainer never waiting; ``overlapped`` the lesser (what running ahead can reach)."""

    split: Split
    generation: float
    training: float

    @property
    def overlapped(self) -> float:
        return min(self.generation, self.training)


def screen(workload: Workload, split: Split) -> Estimate:
    """The steady rates of ``split`` (:class:`Estimate`)."""
    shape = step_shape(workload, split)
    per_server = shape.max_concurrent_rollouts / split.servers * running_share(workload)
    generator = server_generator(workload, split.tensor_parallel)
    tokens = generator.tokens_per_s(per_server, per_server * in_flight_tokens(workload))
    generation = split.servers * tokens / workload.response_lengths.mean
    trainer = trainer_part(workload, split, shape)
    training = workload.samples_per_step / trainer.step_s(shape.forwarded_tokens)
    return Estimate(split, generation, training)
