"""OpenAI's chat-completions wire format, as a black-box agent speaks it to the trainer's capture
endpoint: the request's messages and tools read and checked (a bad field is a 400 naming it),
and a sampled reply written back as a ``chat.completion`` with its tool calls.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs


class BadChatRequest(ValueError):
    """The request cannot be served; the message names the field and the fix (sent as 400)."""


@attrs.frozen
class ChatRequest:
    """What the endpoint samples from: the conversation, its tools (function schemas), and the
    model name the agent asked for (echoed back)."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    model: str


def chat_request(body: object) -> ChatRequest:
    """Read a ``POST /chat/completions`` body.

    Sampling settings (``temperature``, ``max_tokens``, ``n``, ...) are the trainer's: a request
    may leave them out or repeat them, but ``n`` other than 1 and ``stream`` are refused, since
    every captured call is one sampled turn.

    Raises:
        BadChatRequest: naming the field.

    Example:
        >>> chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).tools
    """
    if not isinstance(body, Mapping):
        raise BadChatRequest("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadChatRequest("'messages' must be a non-empty list of chat messages")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise BadChatRequest(f"messages[{index}] must be an object with a 'role'")
    if body.get("stream"):
        raise BadChatRequest("'stream': streamed replies are not captured; send stream=false")
    if body.get("n", 1) != 1:
        raise BadChatRequest(f"'n': {body.get('n')!r}; each captured call samples one reply")
    tools = body.get("tools")
    functions = isinstance(tools, list) and all(
        isinstance(t, Mapping) and isinstance(t.get("function"), Mapping) for t in tools
    )
    if tools is not None and not functions:
        raise BadChatRequest("'tools' must be a list of {'type': 'function', 'function': ...}")
    return ChatRequest(
        messages=tuple(_readable(dict(m)) for m in messages),
        tools=tuple(dict(t) for t in tools) if tools else None,
        model=str(body.get("model", "")),
    )


def _readable(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: tool calls' arguments as objects (agents send the
    JSON text OpenAI's format has)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    readable = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            # text that is not JSON is kept: the template renders it as it was sent
            with contextlib.suppress(json.JSONDecodeError):
                function["arguments"] = json.loads(function["arguments"] or "{}")
        readable.append({**call, "function": function})
    return {**message, "tool_calls": readable}


def chat_completion(
    content: str,
    calls: Sequence[Any],
    *,
    model: str,
    call_ids: Sequence[str],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A ``chat.completion`` object of one reply: its text, its tool calls (``name`` and
    ``arguments`` of each, arguments as JSON text; ``call_ids`` their ids) and the usage."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments))},
            }
            for call, call_id in zip(calls, call_ids, strict=True)
        ]
    return {
        "id": f"chatcmpl-{call_ids[0] if call_ids else int(time.time() * 1000)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if calls else finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
