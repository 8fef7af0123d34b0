"""The tool loop of a rollout: multi-turn tool calling, and the environments of
``environment_factory``.

:meth:`ToolLoop.converse` is what :meth:`AsyncRolloutLoop.generate_one
<asyncgrpo.shell.rollout.loop.AsyncRolloutLoop.generate_one>` does by default: each turn renders
the whole conversation with the chat template, samples a reply (the loop's
``generate_one_turn``), and runs the reply's tool calls in the model's order; it stops at a
reply without tool calls or after ``max_tool_calling_iterations`` tool rounds. A tool's failure
is the model's feedback (an ``Error: ...`` tool message), counted, never a crash.

Environments are made by the factory (one per rollout in flight, pooled and reused across
groups), reset with the row's columns before a rollout, and asked ``get_reward`` after it.
Synchronous tools, factories and environment methods run in a thread pool bounded by
``max_concurrent_rollouts``.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import anyio

from asyncgrpo.adapters.models.chat import (
    ToolCall,
    assistant_message,
    environment_tools,
    render_prompt,
    tool_call_id,
    tool_schema,
)
from asyncgrpo.adapters.models.tool_parsers import (
    ParsedReply,
    ToolCallParser,
    template_takes_string_arguments,
)
from asyncgrpo.core.metrics import mean
from asyncgrpo.core.records import Rollout, TurnRecord
from asyncgrpo.core.rollout.metrics import (
    UNKNOWN_TOOL_CALL,
    tool_call_observations,
    tool_error_feedback,
    unknown_tool_feedback,
)
from asyncgrpo.shell.config import AsyncGRPOConfig

Messages = list[dict[str, Any]]


class Environment(Protocol):
    """What an ``environment_factory`` makes (TRL's AsyncGRPOTrainer documentation): ``reset``
    takes the dataset row's other columns and returns text for the prompt or None; its public
    methods become the rollout's tools."""

    def reset(self, **columns: Any) -> str | None: ...


EnvironmentFactory = Callable[[], Environment] | Mapping[str, Callable[[], Environment]]


def callable_name(fn: Callable[..., Any]) -> str:
    """A readable name for a reward function, tool or factory (partials and instances too)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def reward_names(funcs: Sequence[Callable[..., Any]]) -> list[str]:
    """One distinct name per reward function: two of one name (two partials of a function)
    become ``name`` and ``name_2``, so neither's rewards replace the other's.

    Example:
        >>> reward_names([len, functools.partial(len), max])
        ['len', 'len_2', 'max']
    """
    names: list[str] = []
    for fn in funcs:
        name, n = callable_name(fn), 1
        while (name if n == 1 else f"{name}_{n}") in names:
            n += 1
        names.append(name if n == 1 else f"{name}_{n}")
    return names


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` (a function, a partial, or an instance with ``__call__``) returns
    a coroutine."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (callable instances with async __call__)
    )


class ToolLoop:
    """Tool calls and environments for the rollouts of one rollout loop.

    Args:
        config: ``max_tool_calling_iterations``, ``chat_template_kwargs`` and
            ``max_concurrent_rollouts`` (the thread pool's bound).
        tokenizer: renders the conversation and decodes the replies.
        environment_factory: as the trainer's argument (a callable, a dict of them by the
            row's ``environment`` column, or None).
        doing: the loop's activity recorder, ``doing(what)`` a context manager around a call.
        observe: takes the tool and environment metrics for the loop's next report.
    """

    def __init__(
        self,
        config: AsyncGRPOConfig,
        tokenizer: Any,
        environment_factory: EnvironmentFactory | None,
        doing: Callable[[str], AbstractContextManager[None]],
        observe: Callable[..., None],
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.environment_factory = environment_factory
        self._doing = doing
        self._observe = observe
        self._limiter = anyio.CapacityLimiter(config.max_concurrent_rollouts)
        self._pool: dict[str, list[Environment]] = defaultdict(list)

    async def converse(
        self,
        prompt: Messages,
        tools: list[Callable[..., Any]],
        generate_turn: Callable[[list[int]], Any],
    ) -> Rollout:
        """One rollout: sample with ``generate_turn(prompt_ids)`` (a coroutine function
        returning a :class:`TurnRecord`) and run the tool calls until a reply makes none, or
        ``max_tool_calling_iterations`` rounds are done (see the module docstring)."""
        by_name = {callable_name(t): t for t in tools}
        schemas = [tool_schema(t) for t in tools] or None
        messages = [dict(m) for m in prompt]
        completion: Messages = []
        turns: list[TurnRecord] = []
        calls_made = failures = rounds = 0
        limit = self.config.max_tool_calling_iterations
        if tools:  # the parser's library import (vLLM's: seconds) runs once, off the event loop
            await anyio.to_thread.run_sync(self.tool_call_parser.load, limiter=self._limiter)
        while True:
            prompt_ids = render_prompt(
                self.tokenizer,
                messages,
                schemas,
                self.config.keyword_arguments("chat_template_kwargs"),
            )
            with self._doing("generation"):
                turn = await generate_turn(prompt_ids)
            turns.append(turn)
            text = self.decode(turn.output_ids)
            content, calls = self.parse_reply(text, schemas) if tools else (text, ())
            reply = assistant_message(
                content,
                calls,
                first_call_number=calls_made,
                arguments_as_string=self.arguments_as_string,
            )
            messages.append(reply)
            completion.append(reply)
            if not calls or (limit is not None and rounds >= limit):
                break
            rounds += 1
            self._observe(mean("tools/parallel_calls_mean", len(calls)))
            for call in calls:
                with self._doing(f"tool {call.name!r}"):
                    answer, failed = await self.call_tool(call, by_name)
                call_id = tool_call_id(calls_made)  # as the assistant message gave it
                calls_made += 1
                failures += failed
                message = {
                    "role": "tool",
                    "name": call.name,
                    "tool_call_id": call_id,
                    "content": answer,
                }
                messages.append(message)
                completion.append(message)
        return Rollout(
            completion=completion,
            completion_ids=[t for turn in turns for t in turn.output_ids],
            turns=turns,
            tool_call_count=calls_made,
            tool_failure_count=failures,
        )

    async def call_tool(
        self, call: ToolCall, tools: Mapping[str, Callable[..., Any]]
    ) -> tuple[str, int]:
        """Run one tool call: the tool's answer (or an ``Error: ...`` text for the model) and
        1 if it failed, else 0."""
        if call.error is not None:
            return f"Error: {call.error}", 1
        tool = tools.get(call.name)
        if tool is None:
            self._observe(UNKNOWN_TOOL_CALL)
            return unknown_tool_feedback(call.name, tools), 1
        start = time.monotonic()
        failed = 0
        try:
            if is_async(tool):
                result = await tool(**call.arguments)
            else:
                result = await anyio.to_thread.run_sync(
                    functools.partial(tool, **call.arguments), limiter=self._limiter
                )
            answer = result if isinstance(result, str) else str(result)
        except Exception as error:  # a tool's failure is the model's feedback, not a crash
            failed = 1
            answer = tool_error_feedback(error)
        self._observe(*tool_call_observations(call.name, time.monotonic() - start, failed))
        return answer, failed

    # --- environments --------------------------------------------------------------------

    async def open_environment(
        self,
        prompt: Messages,
        row: Mapping[str, Any],
        row_index: int,
        tools: Sequence[Callable[..., Any]],
    ) -> tuple[Messages, list[Callable[..., Any]], Environment | None]:
        """A rollout's prompt, tools and environment: without an ``environment_factory``,
        copies of ``prompt`` and ``tools`` and None; else an environment (from the pool or the
        factory) reset with ``row``'s columns, its text appended to the last user message (or
        as a new one), and its tools added."""
        prompt = [dict(m) for m in prompt]
        tools = list(tools)
        if self.environment_factory is None:
            return prompt, tools, None
        name = self.environment_name(row)
        pool = self._pool[name]
        if pool:
            environment = pool.pop()
        else:
            with self._doing(f"environment factory {name!r}"):
                environment = await anyio.to_thread.run_sync(
                    self._factory(name), limiter=self._limiter
                )
        kwargs = {k: v for k, v in row.items() if k not in ("prompt", "environment")}
        start = time.monotonic()
        with self._doing(f"{type(environment).__name__}.reset"):
            text = await anyio.to_thread.run_sync(
                functools.partial(environment.reset, **kwargs), limiter=self._limiter
            )
        self._observe(mean("env/reset_s", time.monotonic() - start))
        if isinstance(text, str):
            if prompt and prompt[-1].get("role") == "user":
                prompt[-1]["content"] = f"{prompt[-1].get('content') or ''}{text}"
            else:
                prompt.append({"role": "user", "content": text})
        elif text is not None:
            raise TypeError(
                f"{type(environment).__name__}.reset must return a str or None, "
                f"got {type(text).__name__}"
            )
        if not prompt:
            raise ValueError(
                f"row {row_index} has no 'prompt' and {type(environment).__name__}.reset "
                "returned None; return the prompt from reset() or add a prompt column"
            )
        tools += list(environment_tools(environment).values())
        return prompt, tools, environment

    async def environment_reward(self, environment: object | None) -> tuple[type, float] | None:
        """``(type(environment), get_reward())``, or None without an environment, without a
        ``get_reward`` method or when it returns None."""
        get_reward = getattr(environment, "get_reward", None)
        if get_reward is None:
            return None
        start = time.monotonic()
        with self._doing(f"{type(environment).__name__}.get_reward"):
            if is_async(get_reward):
                reward = await get_reward()
            else:
                reward = await anyio.to_thread.run_sync(get_reward, limiter=self._limiter)
        self._observe(mean("env/reward_s", time.monotonic() - start))
        if reward is None:
            return None
        return type(environment), float(reward)

    def release_environment(self, row: Mapping[str, Any], environment: Environment) -> None:
        """Return a finished rollout's environment to the pool of its kind."""
        self._pool[self.environment_name(row)].append(environment)

    def environment_name(self, row: Mapping[str, Any]) -> str:
        """The factory's key for ``row`` (its ``environment`` column), or "" for a single
        factory.

        Raises:
            ValueError: the column names no factory of the dict.
        """
        if not isinstance(self.environment_factory, Mapping):
            return ""
        name = row.get("environment")
        if name not in self.environment_factory:
            raise ValueError(
                f"dataset row's 'environment' is {name!r}; it must name one of "
                f"{sorted(self.environment_factory)}"
            )
        return str(name)

    def _factory(self, name: str) -> Callable[[], Environment]:
        factory = self.environment_factory
        if isinstance(factory, Mapping):
            return factory[name]
        assert factory is not None
        return factory

    @functools.cached_property
    def tool_call_parser(self) -> ToolCallParser:
        """The reader of the model's tool calls (``config.tool_call_parser``, else the format
        the chat template renders), made on the first reply with tools."""
        return ToolCallParser(self.tokenizer, self.config.tool_call_parser)

    @functools.cached_property
    def arguments_as_string(self) -> bool:
        """The chat template takes each tool call's arguments as JSON text (DeepSeek-V3's),
        not as a dict: :func:`~asyncgrpo.adapters.models.tool_parsers.
        template_takes_string_arguments`."""
        return template_takes_string_arguments(
            self.tokenizer, self.config.keyword_arguments("chat_template_kwargs")
        )

    def parse_reply(
        self, text: str, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> ParsedReply:
        """A reply's text and tool calls, in the model's family's format (``tools``: the
        schemas the prompt offered)."""
        return self.tool_call_parser.parse(text, tools)

    def decode(self, ids: Sequence[int]) -> str:
        """A reply's text, special tokens kept (tool-call tags) but EOS and padding removed."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        for token in (self.tokenizer.eos_token, getattr(self.tokenizer, "pad_token", None)):
            if token:
                text = text.replace(token, "")
        return text
