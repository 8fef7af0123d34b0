"""The capture endpoint: an OpenAI-compatible chat-completions server on 127.0.0.1 in the rollout
process, for agents that run their own loop (black-box harnesses).

Each rollout gets its own base URL, ``http://127.0.0.1:PORT/rollouts/EPISODE/v1``
(:meth:`CaptureEndpoint.base_url`, where ``EPISODE`` is the ``episode_id`` its session was
created with); an agent pointed at it (``OPENAI_BASE_URL``) calls ``POST .../chat/completions``
as it would call any OpenAI-compatible server. Every call is one sampled turn: the conversation
is rendered with the model's chat template and the request's tools, sampled on the rollout's
vLLM server with the run's settings, seeds and policy version (the rollout task's context, as
:meth:`~asyncgrpo.shell.rollout.loop.AsyncRolloutLoop.generate_one_turn` reads it), recorded
with its prompt and completion token ids and sampler log-probs, and answered with the reply's
text and parsed tool calls. A call for a rollout that is not running is refused (404).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import anyio
import attrs
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asyncgrpo.adapters.models.chat import render_prompt
from asyncgrpo.adapters.models.tool_parsers import ParsedReply
from asyncgrpo.adapters.openai_chat import BadChatRequest, chat_completion, chat_request
from asyncgrpo.core.records import TurnRecord
from asyncgrpo.shell.rollout import context, root_cause

HOST = "127.0.0.1"


@attrs.define
class CapturedRollout:
    """What one rollout's agent did through the endpoint.

    Attributes:
        carried: the rollout task's context (:func:`~asyncgrpo.shell.rollout.context.carried`).
        turns: every sampled call, in order.
        transcript: the last call's conversation and its reply (OpenAI's message format).
        sampling_error: a sampling request that failed (the server's fault, raised by the
            rollout as any rollout's would be).
    """

    carried: list[Any]
    turns: list[TurnRecord] = attrs.field(factory=list)
    transcript: list[dict[str, Any]] = attrs.field(factory=list)
    sampling_error: Exception | None = None
    sampling: set[anyio.CancelScope] = attrs.field(factory=set)  # the calls being sampled


_serving: list[CaptureEndpoint] = []  # the endpoint serving in this process (one loop a process)


def capture_url(episode_id: str) -> str:
    """The OpenAI base URL the agent of rollout ``episode_id`` calls: for a session factory of
    a loop-owning :class:`~asyncgrpo.HarnessAsyncGRPOTrainer`, inside ``create(task, seed,
    episode_id)`` (it runs in the rollout process, where the endpoint serves).

    Raises:
        RuntimeError: no capture endpoint serves in this process.
    """
    if not _serving:
        raise RuntimeError(
            "capture_url answers inside the rollout process of a "
            "HarnessAsyncGRPOTrainer without a harness_adapter (loop-owning), "
            "from its session factory's create()"
        )
    return _serving[-1].base_url(episode_id)


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the rollout process's signals stay the trainer's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class CaptureEndpoint:
    """The endpoint of one rollout loop (see the module docstring).

    Args:
        sample: one sampled turn of a prompt, in the current task's context (the loop's
            ``generate_one_turn``).
        tokenizer: renders the conversation.
        decode: a reply's text, tool-call tags kept (the tool loop's).
        parse_reply: a reply's text and tool calls, from its text and the request's tools (the
            tool loop's, in the model's family's format).
        chat_template_kwargs: the config's.
        max_completion_length: a reply this long was cut (``finish_reason`` ``length``).
    """

    def __init__(
        self,
        sample: Callable[[list[int]], Awaitable[TurnRecord]],
        tokenizer: Any,
        decode: Callable[[Any], str],
        parse_reply: Callable[[str, Any], ParsedReply],
        chat_template_kwargs: Any,
        max_completion_length: int,
    ) -> None:
        self._sample = sample
        self._tokenizer = tokenizer
        self._decode = decode
        self._parse_reply = parse_reply
        self._template_kwargs = chat_template_kwargs
        self._max_completion_length = max_completion_length
        self.rollouts: dict[str, CapturedRollout] = {}
        self.port: int | None = None
        self._call_ids = itertools.count()
        self._app = Starlette(
            routes=[
                Route("/rollouts/{episode}/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/rollouts/{episode}/v1/models", self._models, methods=["GET"]),
            ]
        )

    def base_url(self, episode_id: str) -> str:
        """The OpenAI base URL of rollout ``episode_id`` (while the endpoint serves)."""
        if self.port is None:
            raise RuntimeError("the capture endpoint is not serving")
        return f"http://{HOST}:{self.port}/rollouts/{episode_id}/v1"

    def open(self, episode_id: str, carried: list[Any]) -> CapturedRollout:
        """Start capturing rollout ``episode_id``'s calls."""
        captured = self.rollouts[episode_id] = CapturedRollout(carried)
        return captured

    def close(self, episode_id: str) -> None:
        """Stop serving rollout ``episode_id``: the calls being sampled are cancelled (503),
        later ones get 404. From the event loop's thread."""
        captured = self.rollouts.pop(episode_id, None)
        for scope in captured.sampling if captured is not None else ():
            scope.cancel()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Serve on a free port of 127.0.0.1 while the block runs."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HOST, 0))
        self.port = listener.getsockname()[1]
        server = _QuietServer(
            uvicorn.Config(self._app, log_level="warning", lifespan="off", access_log=False)
        )
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve, [listener])
                while not server.started:
                    await anyio.sleep(0.01)
                _serving.append(self)
                try:
                    yield
                finally:
                    _serving.remove(self)
                    server.should_exit = True
        except BaseExceptionGroup as group:  # what the block raised, not wrapped by the group
            raise root_cause(group) from None
        finally:
            listener.close()
            self.port = None

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "asyncgrpo", "object": "model"}]})

    async def _chat(self, request: Request) -> JSONResponse:
        episode = request.path_params["episode"]
        captured = self.rollouts.get(episode)
        if captured is None:
            return _error(
                404,
                f"no rollout {episode!r} is running: a rollout's URL serves only "
                "while its rollout runs",
            )
        try:
            asked = chat_request(await request.json())
        except ValueError as error:  # a body that is not JSON, or a bad field
            return _error(
                400,
                str(error)
                if isinstance(error, BadChatRequest)
                else f"the body is not JSON: {error}",
            )
        prompt_ids = render_prompt(
            self._tokenizer, asked.messages, asked.tools, self._template_kwargs
        )
        context.adopt(captured.carried)  # the rollout's server, seeds and policy version
        turn = None
        with anyio.CancelScope() as scope:
            captured.sampling.add(scope)
            try:
                turn = await self._sample(prompt_ids)
            except Exception as error:  # the server's fault: the rollout raises it
                captured.sampling_error = error
                return _error(503, f"sampling failed: {type(error).__name__}: {error}")
            finally:
                captured.sampling.discard(scope)
        if turn is None:
            return _error(503, f"rollout {episode!r} ended while this call was sampled")
        captured.turns.append(turn)
        content, calls = self._parse_reply(self._decode(turn.output_ids), asked.tools)
        calls = tuple(c for c in calls if c.error is None)
        reply = chat_completion(
            content,
            calls,
            model=asked.model or "asyncgrpo",
            call_ids=[f"call_{next(self._call_ids)}" for _ in calls],
            finish_reason="length"
            if len(turn.output_ids) >= self._max_completion_length
            else "stop",
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(turn.output_ids),
        )
        captured.transcript = [*asked.messages, reply["choices"][0]["message"]]
        return JSONResponse(reply)


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)
