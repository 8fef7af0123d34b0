"""A vLLM server with an API key: every route but the probes and metrics answers 401 without
it, the dev-mode and weight-transfer routes included, whether the key is enforced by
``--middleware asyncgrpo.adapters.vllm.auth.DevRoutesAuth`` (servers asyncgrpo starts) or by
asyncgrpo's vLLM plugin over vLLM's own ``--api-key`` check (servers users start); a trainer
given the key trains against it."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest
from datasets import Dataset
from side_by_side import BackgroundStart

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.adapters.vllm.auth import bearer, configured_keys, new_api_key
from asyncgrpo.adapters.vllm.client import ServerAuthError, VLLMClient
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer
from asyncgrpo.shell.commands.demo import digit_fraction_reward
from asyncgrpo.shell.run import read_metrics

pytestmark = pytest.mark.server

GUARDED = [
    ("POST", "/pause", {"params": {"mode": "keep"}}),
    ("POST", "/resume", {}),
    ("POST", "/collective_rpc", {"json": {"method": "reload_weights"}}),
    ("POST", "/reset_prefix_cache", {}),
    ("GET", "/server_info", {}),
    ("POST", "/init_weight_transfer_engine", {"json": {"init_info": {}}}),
    ("POST", "/start_weight_update", {}),
    ("POST", "/tokenize", {"json": {}}),
    ("GET", "/v1/models", {}),
]
PUBLIC = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/version")]


class PluginOnlySpec(ServerSpec):
    """The key in ``VLLM_API_KEY`` (vLLM's own check), without asyncgrpo's ``--middleware``:
    only the plugin widens vLLM's check to every route, as on a server a user starts."""

    def command(self, port: int) -> list[str]:
        args = super().command(port)
        at = args.index("--middleware")
        return args[:at] + args[at + 2 :]


def start_keyed_servers(tiny_qwen3: Path, logs: Path) -> list[BackgroundStart]:
    """Both kinds of keyed server, starting side by side (about the time of one)."""
    starts = []
    for kind, spec_type in (("middleware", ServerSpec), ("plugin", PluginOnlySpec)):
        spec = spec_type(
            enforce_eager=True,
            model=str(tiny_qwen3),
            max_model_len=1024,
            dtype="float32",
            weight_transfer_backend="asyncgrpo_gloo",
            api_key=new_api_key(),
        )
        assert ("--middleware" in spec.command(8000)) == (kind == "middleware")
        starts.append(BackgroundStart(VLLMServer(spec, log_path=logs / f"vllm-{kind}.log")))
    return starts


# started ahead of this module's first test (tests/conftest.py: ServersAhead)
SERVERS_STARTED_AHEAD = {"keyed_servers": start_keyed_servers}


@pytest.fixture(scope="module")
def keyed_servers(request, servers_ahead, tiny_qwen3):
    """Both kinds of keyed server by kind, with their keys."""
    starts = servers_ahead.take_or_start("keyed_servers", tiny_qwen3, request.module)
    try:
        servers = [start.result() for start in starts]
        yield {
            kind: (server, server.spec.api_key)
            for kind, server in zip(("middleware", "plugin"), servers, strict=True)
        }
    finally:
        for start in starts:
            start.stop()


@pytest.fixture(params=["middleware", "plugin"])
def keyed_server(request, keyed_servers):
    server, key = keyed_servers[request.param]
    return server, key, request.param


def test_without_the_key_dev_and_weight_routes_answer_401(keyed_server) -> None:
    server, key, _ = keyed_server
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for method, path, kwargs in GUARDED:
            for headers in ({}, bearer("wrong"), {"Authorization": key}):
                answer = client.request(method, path, headers=headers, **kwargs)
                assert answer.status_code == 401, (method, path, headers, answer.text[:200])
        for method, path in PUBLIC:
            assert client.request(method, path).status_code == 200, path
        assert client.get("/v1/models", headers=bearer(key)).status_code == 200
        assert client.get("/is_paused", headers=bearer(key)).status_code == 200
        assert client.get("/is_paused").status_code == 401
    assert key not in " ".join(server.spec.command(server.port))  # passed in the environment


def test_the_client_names_the_key_setting_when_the_server_refuses_it(keyed_server) -> None:
    """Through :class:`VLLMClient`: without the key or with another one, an OpenAI route
    (vLLM's own check) and a dev route (asyncgrpo's) raise an error naming the settings that
    carry the key; with the key both answer."""
    server, key, _ = keyed_server
    for headers in ({}, bearer("wrong")):
        with pytest.raises(ServerAuthError) as raised:
            anyio.run(_served_models_then_resume, server, headers)
        message = str(raised.value)
        assert message.startswith("/v1/models: the server refused the request's API key (HTTP 401")
        assert "vllm_server_api_key" in message and "VLLM_API_KEY" in message
        with pytest.raises(ServerAuthError, match=r"^/resume: .*HTTP 401: Unauthorized"):
            anyio.run(_resume, server, headers)
    assert anyio.run(_served_models_then_resume, server, bearer(key)) == [server.spec.name]


async def _served_models_then_resume(server: VLLMServer, headers: dict[str, str]) -> list[str]:
    async with VLLMClient(server.base_url, server.spec.name, 60.0, headers=headers) as client:
        served = await client.served_models()
        await client.admin.resume()
        return served


async def _resume(server: VLLMServer, headers: dict[str, str]) -> None:
    async with VLLMClient(server.base_url, server.spec.name, 60.0, headers=headers) as client:
        await client.admin.resume()


@pytest.mark.parametrize("backend", ["asyncgrpo_gloo", "disk"])
def test_a_run_with_the_key_trains(keyed_server, tiny_qwen3, tmp_path, backend) -> None:
    """In memory (the weight-transfer routes) and by disk reload (/collective_rpc), with the
    pause, resume and prefix-cache reset of every sync."""
    server, key, kind = keyed_server
    if kind == "plugin" and backend == "disk":
        pytest.skip("one run per server kind is enough for the plugin's path")
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        learning_rate=1e-3,
        num_generations=4,
        max_completion_length=12,
        token_budget=256,
        gradient_checkpointing=False,
        num_sampler_logprobs=4,
        max_staleness=0,
        vllm_server_base_url=server.base_url,
        vllm_server_api_key=key,
        weight_transfer_backend=backend,
        save_steps=1000,
        disable_tqdm=True,
    )
    prompts = [[{"role": "user", "content": f"Number {i}?"}] for i in range(8)]
    trainer = AsyncGRPOTrainer(
        model=str(tiny_qwen3),
        reward_funcs=digit_fraction_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )
    assert trainer.train().global_step == 2
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # the pushes reached the server: staleness-0 parity
        assert row["sampling/sampling_logp_difference/max"] < 1e-4, row
    assert key not in str(args) and args.to_dict()["vllm_server_api_key"] != key


def test_the_server_reads_its_key_as_vllm_does(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert configured_keys(["vllm", "serve", "m", "--api-key", "k1"]) == ["k1"]
    assert configured_keys(["serve", "--api-key=k2"]) == ["k2"]
    assert configured_keys(["serve", "m"]) == ["from-env"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert configured_keys(["serve", "m"]) == []
