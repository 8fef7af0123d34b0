"""The launch commands of a planned split: a ``vllm serve`` per server with its devices, host,
port and key, and the trainer's ``torchrun`` over its devices; a Slurm batch script when the
split spans nodes. Every launch names its devices (``CUDA_VISIBLE_DEVICES``), the servers'
and the trainer's never overlap, and ``--nproc_per_node`` is the trainer's devices per node:
the rules of docs/gpu.md, which ``tests/test_launch_commands.py`` checks on the docs.

The trainer runs ``asyncgrpo train`` with the planned settings as flags; ``train.toml`` holds
the user's dataset and reward functions (docs/configuration.md).

Example:
    >>> from asyncgrpo.core.experiments.gpu_plan import Layout
    >>> blocks = launch_blocks("Qwen/Qwen3-8B", Layout(((0, (2, 3)),), ((0, (0, 1)),)),
    ...                        gpus_per_node=8, max_model_len=4096, weight_path="nccl",
    ...                        settings={"max_staleness": 1})
    >>> print(blocks[0].text.splitlines()[-2])
    CUDA_VISIBLE_DEVICES=2,3 torchrun --nproc_per_node=2 -m asyncgrpo train --config train.toml \\
    >>> print(blocks[0].text.splitlines()[-1])
        --model Qwen/Qwen3-8B --vllm_server_base_url http://127.0.0.1:8000 --max_staleness 1
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

import attrs

from asyncgrpo.core.experiments.gpu_plan import Layout
from asyncgrpo.core.weights.sync import GLOO, NCCL

FIRST_PORT = 8000
ENGINE_OF_PATH = {"nccl": NCCL, "delta": GLOO}
"""The servers' weight-transfer engine for each weight path that uses one (a delta push runs
through ``asyncgrpo_gloo``)."""
RDZV_PORT = 29400
NEW_KEY = "export VLLM_API_KEY=\"$(python -c 'import secrets; print(secrets.token_urlsafe(32))')\""
WAIT_FOR = (
    "for url in ${{VLLM_URLS//,/ }}; do\n"
    '    until curl -sf "$url/health" > /dev/null; do sleep 10; done\ndone'
)


@attrs.frozen
class Block:
    """One file or shell session: ``title`` says where it runs, ``text`` is bash."""

    title: str
    text: str


def _devices(devices: Sequence[int]) -> str:
    return ",".join(str(d) for d in devices)


def _wrap(words: Sequence[str]) -> str:
    """A command over lines of at most ~96 characters, continued with backslashes; an option
    stays on the line of its value."""
    units: list[str] = []
    for word in words:
        if (
            units
            and units[-1].startswith("--")
            and " " not in units[-1]
            and ("=" not in units[-1] and not word.startswith("-"))
        ):
            units[-1] += " " + word
        else:
            units.append(word)
    lines, line = [], ""
    for unit in units:
        if line.strip() and len(line) + len(unit) + 1 > 96:
            lines.append(line + " \\")
            line = "   "
        line += " " + unit if line else unit
    return "\n".join([*lines, line])


def server_command(
    model: str,
    devices: Sequence[int],
    host: str,
    port: int,
    max_model_len: int,
    weight_path: str,
    max_loras: int,
) -> str:
    """One ``vllm serve``, bound to ``host`` (a quoted shell word), with the key's middleware."""
    env = [f"CUDA_VISIBLE_DEVICES={_devices(devices)}", "VLLM_SERVER_DEV_MODE=1"]
    if weight_path == "lora":
        env.append("VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
    words = [*env, "vllm", "serve", shlex.quote(model), "--host", host, "--port", str(port)]
    if len(devices) > 1:
        words += ["--tensor-parallel-size", str(len(devices))]
    words += ["--middleware", "asyncgrpo.adapters.vllm.auth.DevRoutesAuth"]
    if weight_path in ENGINE_OF_PATH:
        config = f'{{"backend": "{ENGINE_OF_PATH[weight_path]}"}}'
        words += ["--weight-transfer-config", shlex.quote(config)]
    if weight_path == "lora":
        words += ["--enable-lora", "--max-loras", str(max_loras)]
    words += [
        "--logprobs-mode",
        "processed_logprobs",
        "--api-server-count",
        "8",
        "--max-model-len",
        str(max_model_len),
    ]
    return _wrap(words)


def trainer_command(
    model: str, devices: Sequence[int], nodes: int, urls: str, settings: Mapping[str, object]
) -> str:
    """The trainer's ``torchrun`` of ``asyncgrpo train`` with ``settings`` as flags."""
    words = [f"CUDA_VISIBLE_DEVICES={_devices(devices)}", "torchrun"]
    if nodes > 1:
        words += [
            f"--nnodes={nodes}",
            "--rdzv_backend=c10d",
            f'--rdzv_endpoint="$RDZV_NODE:{RDZV_PORT}"',
            '--rdzv_id="$SLURM_JOB_ID"',
        ]
    words += [
        f"--nproc_per_node={len(devices)}",
        "-m",
        "asyncgrpo",
        "train",
        "--config",
        "train.toml",
        "--model",
        shlex.quote(model),
        "--vllm_server_base_url",
        urls,
    ]
    for name, value in settings.items():
        words += [f"--{name}", shlex.quote(str(value))]
    return _wrap(words)


def launch_blocks(
    model: str,
    where: Layout,
    gpus_per_node: int,
    max_model_len: int,
    weight_path: str,
    settings: Mapping[str, object],
    max_loras: int = 2,
) -> tuple[Block, ...]:
    """The commands of ``where`` (the module's docstring): one block on one node; on several,
    a script per node that serves, a script for the trainer's nodes (or the first node's
    servers and trainer), and the Slurm batch script that starts them."""
    servers = list(where.servers)
    ports = [
        FIRST_PORT + sum(1 for n, _ in servers[:i] if n == node)
        for i, (node, _) in enumerate(servers)
    ]
    if where.nodes == 1:
        lines = [NEW_KEY]
        lines += [
            server_command(model, devices, "127.0.0.1", port, max_model_len, weight_path, max_loras)
            + " &"
            for (_, devices), port in zip(servers, ports, strict=True)
        ]
        urls = ",".join(f"http://127.0.0.1:{port}" for port in ports)
        lines.append(f"export VLLM_URLS={urls}")
        lines.append(WAIT_FOR.format())
        lines.append(trainer_command(model, where.trainer[0][1], 1, urls, settings))
        return (Block("on the node, from one shell", "\n".join(lines)),)
    blocks = []
    trainer_nodes = [node for node, _ in where.trainer]
    for node in sorted({n for n, _ in servers}):
        own = [
            server_command(
                model, devices, '"$(hostname)"', port, max_model_len, weight_path, max_loras
            )
            + " &"
            for (n, devices), port in zip(servers, ports, strict=True)
            if n == node
        ]
        if node in trainer_nodes:  # the trainer's one node also serves: start both here
            own += [
                WAIT_FOR.format(),
                trainer_command(model, where.trainer[0][1], 1, '"$VLLM_URLS"', settings),
            ]
        else:
            own.append("wait")
        name = "train.sh" if node in trainer_nodes else f"serve_{node}.sh"
        blocks.append(
            Block(
                f"{name}: node {node}",
                f"#!/bin/bash\n# {name}\nset -euo pipefail\n" + "\n".join(own),
            )
        )
    if not set(trainer_nodes) & {n for n, _ in servers}:
        command = trainer_command(
            model, where.trainer[0][1], len(trainer_nodes), '"$VLLM_URLS"', settings
        )
        blocks.append(
            Block(
                f"train.sh: nodes {', '.join(map(str, trainer_nodes))}",
                f"#!/bin/bash\n# train.sh\nset -euo pipefail\n{command}",
            )
        )
    urls = ",".join(
        f"http://${{nodes[{node}]}}:{port}" for (node, _), port in zip(servers, ports, strict=True)
    )
    job = [
        "#!/bin/bash",
        "# job.sbatch",
        "#SBATCH --job-name=asyncgrpo",
        f"#SBATCH --nodes={where.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        "#SBATCH --exclusive",
        "set -euo pipefail",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        f"export RDZV_NODE=${{nodes[{trainer_nodes[0]}]}}",
        NEW_KEY,
        f'export VLLM_URLS="{urls}"',
    ]
    step = f"srun --nodes=1 --ntasks=1 --gpus-per-node={gpus_per_node}"
    for node in sorted({n for n, _ in servers} - set(trainer_nodes)):
        job.append(f'{step} --nodelist="${{nodes[{node}]}}" bash serve_{node}.sh &')
    listed = ",".join(f"${{nodes[{n}]}}" for n in trainer_nodes)
    if not set(trainer_nodes) & {n for n, _ in servers}:
        job.append(WAIT_FOR.format())
    job.append(
        f"srun --nodes={len(trainer_nodes)} --ntasks-per-node=1 "
        f'--gpus-per-node={gpus_per_node} --nodelist="{listed}" bash train.sh'
    )
    blocks.append(Block("job.sbatch: sbatch job.sbatch starts the lot", "\n".join(job)))
    return tuple(blocks)
