"""Chat templates, tool schemas and tool-call parsing.

Tool calls are read in the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` form that
Qwen/Hermes-style templates (and the tiny models' template) use.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import attrs
from transformers import PreTrainedTokenizerBase
from transformers.utils import get_json_schema

from asyncgrpo.adapters.models.vision_language import reject_images

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

Message = Mapping[str, Any]


@attrs.frozen
class ToolCall:
    """One call the model asked for; ``error`` is set when the call could not be parsed."""

    name: str
    arguments: Mapping[str, Any]
    error: str | None = None


def parse_tool_calls(text: str) -> tuple[str, tuple[ToolCall, ...]]:
    """Split an assistant reply into its text and its tool calls, in the model's order.

    A call whose JSON does not parse is kept with an ``error`` so the loop can count it and
    answer the model with a tool error.

    Example:
        >>> content, calls = parse_tool_calls(
        ...     'ok<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
        >>> content, calls[0].name, dict(calls[0].arguments)
        ('ok', 'add', {'a': 1})
    """
    calls: list[ToolCall] = []
    for body in _TOOL_CALL.findall(text):
        try:
            payload = json.loads(body)
            name = payload["name"]
            arguments = payload.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append(ToolCall(name=name, arguments=arguments))
        except (ValueError, KeyError, TypeError) as error:
            calls.append(ToolCall(name="", arguments={}, error=f"malformed tool call: {error}"))
    content = _TOOL_CALL.sub("", text).strip()
    return content, tuple(calls)


def tool_call_id(number: int) -> str:
    """The id of a conversation's ``number``-th tool call (from 0): 9 letters and digits, the
    form Mistral's chat templates require (they refuse a call without one).

    Example:
        >>> tool_call_id(12)
        'call00012'
    """
    return f"call{number:05d}"


def assistant_message(
    content: str,
    calls: Sequence[ToolCall],
    first_call_number: int = 0,
    arguments_as_string: bool = False,
) -> dict[str, Any]:
    """The assistant message for the conversation, with its tool calls; the calls' ids are
    :func:`tool_call_id` from ``first_call_number`` on (the conversation's calls before).
    Each call's arguments are a dict, or its JSON text with ``arguments_as_string`` (for the
    templates that write them as a string, DeepSeek-V3's:
    :func:`~asyncgrpo.adapters.models.tool_parsers.template_takes_string_arguments`).

    Example:
        >>> call = ToolCall("add", {"a": 2})
        >>> assistant_message("", [call], arguments_as_string=True)["tool_calls"][0]["function"]
        {'name': 'add', 'arguments': '{"a": 2}'}
    """
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": tool_call_id(first_call_number + i),
                "type": "function",
                "function": {
                    "name": c.name,
                    "arguments": (
                        json.dumps(dict(c.arguments)) if arguments_as_string else dict(c.arguments)
                    ),
                },
            }
            for i, c in enumerate(calls)
        ]
    return message


def tool_schema(tool: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a tool from its signature and Google-style docstring.

    Raises:
        TypeError: naming the tool when its hints or docstring do not describe it.
    """
    try:
        return get_json_schema(tool)
    except Exception as error:
        name = getattr(tool, "__name__", repr(tool))
        raise TypeError(
            f"tool {name!r} cannot be described to the model: {error}. Give it type hints "
            "and a Google-style docstring with an Args section"
        ) from error


def environment_tools(environment: object) -> dict[str, Callable[..., Any]]:
    """An environment's public methods, exposed as tools (``reset``/``get_reward`` excluded)."""
    tools: dict[str, Callable[..., Any]] = {}
    for name, member in inspect.getmembers(environment, callable):
        if name.startswith("_") or name in ("reset", "get_reward"):
            continue
        tools[name] = member
    return tools


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> list[int]:
    """Token ids of the conversation with the generation prompt appended.

    Raises:
        ValueError: a message carries an image or a video (not supported).
    """
    reject_images(messages)
    ids = tokenizer.apply_chat_template(
        # transformers types messages as dicts of strings; tool calls and content parts are not
        list(messages),  # type: ignore[arg-type]
        tools=[dict(tool) for tool in tools] if tools else None,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **dict(chat_template_kwargs or {}),
    )
    # one conversation, tokenized, not as a dict: its token ids (the return type spans every mode)
    return [int(i) for i in cast(list[int], ids)]
