"""Tool calls of each model family, and the chat-template checks of a tool-calling run.

A model writes its tool calls in its family's format. The format is chosen from the chat
template (what the template writes when it renders an assistant message with ``tool_calls``)
or named with ``AsyncGRPOConfig.tool_call_parser``, using vLLM's ``--tool-call-parser`` names:

==============  ==============================================================  ================
name            a call as the model writes it                                   parsed by
==============  ==============================================================  ================
hermes          ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``    this module
llama3_json     ``<|python_tag|>{"name": ..., "parameters": {...}}`` (tag       vLLM
                optional)
mistral         ``[TOOL_CALLS][{"name": ..., "arguments": ...}]`` (tokenizers   vLLM
                without ``[ARGS]``), ``[TOOL_CALLS]name[ARGS]{...}`` (with it)
openai          gpt-oss harmony: ``<|channel|>commentary to=functions.NAME      openai_harmony
                <|constrain|>json<|message|>{...}<|call|>``
deepseek_v3     ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>     vLLM
                NAME`` and the arguments in a json code block
deepseek_v31    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}``   vLLM
                (DeepSeek-V3.1: told from V3 by rendering a call)
qwen3_coder     ``<tool_call><function=NAME><parameter=P>value</parameter>...``   vLLM
==============  ==============================================================  ================

Hermes/Qwen calls are parsed here (the most common format; no vLLM import, and each malformed
call is reported on its own). The others use vLLM's tool parsers (``vllm.tool_parsers``, as
``vllm serve --tool-call-parser NAME`` does), imported on the first reply that is parsed: the
import takes 10-25 s on 2 CPU cores, paid once by the rollout process and only by runs whose
model is not Hermes-style. gpt-oss replies are read with ``openai_harmony`` (the library vLLM's
own harmony parser uses; vLLM's ``openai`` tool parser is a stub that points to it).

A reply that carries the family's call marker but yields no call (cut off, bad JSON) gives one
:class:`~asyncgrpo.adapters.models.chat.ToolCall` with ``error`` set, so the tool loop counts it
and tells the model.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import structlog

from asyncgrpo.adapters.models.chat import ToolCall, parse_tool_calls

log = structlog.get_logger("asyncgrpo.tools")

ParsedReply = tuple[str, tuple[ToolCall, ...]]

_MISTRAL_CALL_ID = re.compile(r"\[CALL_ID\][A-Za-z0-9]*")


@attrs.frozen
class ToolCallFormat:
    """One family's tool-call format.

    Attributes:
        name: vLLM's ``--tool-call-parser`` name (``AsyncGRPOConfig.tool_call_parser``).
        family: the models that write it, for messages.
        template_markers: a chat template containing any of these renders this format.
        attempted: matches a reply in which the model tried a call of this format.
    """

    name: str
    family: str
    template_markers: tuple[str, ...]
    attempted: re.Pattern[str]


TOOL_CALL_FORMATS: tuple[ToolCallFormat, ...] = (
    # Before hermes: Qwen3-Coder's template writes <tool_call> around its XML calls too.
    ToolCallFormat("qwen3_coder", "Qwen3-Coder (XML)", ("<function=",), re.compile(r"<function=")),
    ToolCallFormat(  # gpt-oss's template writes "to=" and "functions." apart
        "openai",
        "gpt-oss (harmony)",
        ("to=functions.", "namespace functions", "<|call|>"),
        re.compile(r"to=functions\."),
    ),
    ToolCallFormat(
        "deepseek_v3",
        "DeepSeek-V3/R1",
        ("tool▁calls▁begin",),
        re.compile(r"<｜tool▁calls?▁begin｜>"),
    ),
    ToolCallFormat(  # no marker of its own: a DeepSeek template that renders a call this way
        "deepseek_v31", "DeepSeek-V3.1", (), re.compile(r"<｜tool▁calls?▁begin｜>")
    ),
    ToolCallFormat("mistral", "Mistral", ("[TOOL_CALLS]",), re.compile(r"\[TOOL_CALLS\]")),
    ToolCallFormat(
        "llama3_json",
        "Llama 3.x (JSON)",
        ("<|python_tag|>",),
        re.compile(r"^\s*(<\|python_tag\|>|\{\s*\"name\")"),
    ),
    ToolCallFormat("hermes", "Hermes/Qwen", ("<tool_call>",), re.compile(r"<tool_call>")),
)
"""The formats, in the order detection tries them (the first whose marker the template has)."""

TOOL_CALL_PARSER_NAMES: tuple[str, ...] = tuple(f.name for f in TOOL_CALL_FORMATS)
_BY_NAME = {f.name: f for f in TOOL_CALL_FORMATS}


def detect_tool_call_format(chat_template: str | None) -> ToolCallFormat | None:
    """The format a chat template renders tool calls in, or None when no known marker is in it.

    Example:
        >>> detect_tool_call_format("{{- '[TOOL_CALLS]' + calls | tojson }}").name
        'mistral'
        >>> detect_tool_call_format("{{ message.content }}") is None
        True
    """
    for candidate in TOOL_CALL_FORMATS:
        if any(marker in (chat_template or "") for marker in candidate.template_markers):
            return candidate
    return None


def check_tool_call_parser_name(name: str | None) -> None:
    """Raise a ``ValueError`` naming ``AsyncGRPOConfig.tool_call_parser`` when ``name`` is
    neither None (detect from the chat template) nor one of :data:`TOOL_CALL_PARSER_NAMES`."""
    if name is not None and name not in _BY_NAME:
        raise ValueError(
            f"AsyncGRPOConfig.tool_call_parser={name!r} is not a known tool-call format; use "
            f"one of {', '.join(TOOL_CALL_PARSER_NAMES)}, or None to choose it from the chat "
            "template"
        )


def chat_template_text(tokenizer: Any) -> str:
    """The tokenizer's default chat template ("" when it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates: the default one renders the prompts
        template = template.get("default") or template.get("tool_use") or ""
    return template or ""


def _template_name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


class ToolCallParser:
    """Reads the tool calls of one model's replies (see the module docstring).

    Args:
        tokenizer: the model's tokenizer (vLLM's parsers look their tokens up in its vocabulary).
        name: a name of :data:`TOOL_CALL_PARSER_NAMES`, or None to detect it from the
            tokenizer's chat template.

    Raises:
        ValueError: ``name`` is unknown, or None and the chat template renders no known
            format; the message names the template and ``AsyncGRPOConfig.tool_call_parser``.
    """

    def __init__(self, tokenizer: Any, name: str | None = None) -> None:
        check_tool_call_parser_name(name)
        found = _BY_NAME[name] if name is not None else None
        found = found or detect_tool_call_format(chat_template_text(tokenizer))
        if found is None:
            raise ValueError(
                f"the chat template of {_template_name(tokenizer)!r} renders tool calls in no "
                f"format asyncgrpo knows (it contains none of "
                f"{', '.join(m for f in TOOL_CALL_FORMATS for m in f.template_markers)}), so the "
                "model's tool calls could not be read; set AsyncGRPOConfig.tool_call_parser to "
                f"one of {', '.join(TOOL_CALL_PARSER_NAMES)}, or give the tokenizer a chat "
                "template that renders tool calls"
            )
        if name is None and found.name == "deepseek_v3" and _renders_deepseek_v31(tokenizer):
            found = _BY_NAME["deepseek_v31"]
        self.format = found
        self._tokenizer = tokenizer
        self._lock = threading.Lock()  # vLLM's parsers keep state while parsing one reply
        self._vllm_parser: Any = None
        self._harmony: Any = None

    def load(self) -> None:
        """Import and build the library parser (vLLM's, or harmony's encoding) now rather than
        on the first reply; nothing to do for Hermes.

        Raises:
            ValueError: the parser does not fit the tokenizer (vLLM's look their marker
                tokens up in its vocabulary), naming the template and the setting.
        """
        with self._lock:
            if self.name == "hermes" or self._vllm_parser is not None or self._harmony is not None:
                return
            try:
                if self.name == "openai":
                    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

                    self._harmony = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
                else:
                    from vllm.tool_parsers import ToolParserManager

                    parser_cls = ToolParserManager.get_tool_parser(self.name)
                    self._vllm_parser = parser_cls(self._tokenizer)
            except (RuntimeError, ValueError, KeyError) as error:
                raise ValueError(
                    f"the {self.format.family} tool-call parser ({self.name!r}) does not fit "
                    f"the tokenizer of {_template_name(self._tokenizer)!r}: {error}. Set "
                    "AsyncGRPOConfig.tool_call_parser to the format the model writes, or None "
                    "to choose it from the chat template"
                ) from error

    @property
    def name(self) -> str:
        """vLLM's name of the format (``AsyncGRPOConfig.tool_call_parser``)."""
        return self.format.name

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedReply:
        """Split a reply into its text and its tool calls, in the model's order.

        Args:
            text: the reply, special tokens kept (EOS and padding removed).
            tools: the JSON schemas the prompt offered (:func:`~asyncgrpo.adapters.models.
                chat.tool_schema`); Qwen3-Coder's parameters are typed by them.
        """
        if self.name == "hermes":
            return parse_tool_calls(text)
        self.load()
        if self.name == "openai":
            content, calls = self._parse_harmony(text)
        else:
            content, calls = self._parse_with_vllm(text, tools)
        if not calls and self.format.attempted.search(text):
            calls = (
                ToolCall(
                    name="",
                    arguments={},
                    error=f"malformed tool call: the reply starts a {self.format.family} "
                    "tool call that does not parse",
                ),
            )
        return content, calls

    def _parse_with_vllm(self, text: str, tools: Sequence[Mapping[str, Any]] | None) -> ParsedReply:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(
            model="asyncgrpo", messages=[], tools=[dict(t) for t in tools or []] or None
        )
        if self.name == "mistral":  # v11 models write a call id, which vLLM's parser reads
            text = _MISTRAL_CALL_ID.sub("", text)  # as part of the name
        try:
            with self._lock:
                extracted = self._vllm_parser.extract_tool_calls(text, request)
        except Exception as error:  # the reply's fault (a parser's regex timeout, say): feedback
            message = f"malformed tool call: {type(error).__name__}: {error}"
            return text.strip(), (ToolCall(name="", arguments={}, error=message),)
        if not extracted.tools_called:
            return text.strip(), ()
        calls = tuple(
            _call(call.function.name, call.function.arguments) for call in extracted.tool_calls
        )
        return (extracted.content or "").strip(), calls

    def _parse_harmony(self, text: str) -> ParsedReply:
        from openai_harmony import HarmonyError, Role

        encoding = self._harmony
        try:
            messages = encoding.parse_messages_from_completion_tokens(
                encoding.encode(text, allowed_special="all"), Role.ASSISTANT
            )
        except HarmonyError:
            return text.strip(), ()
        content: list[str] = []
        calls: list[ToolCall] = []
        for message in messages:
            body = "".join(getattr(part, "text", "") for part in message.content)
            recipient = message.recipient or ""
            if recipient.startswith("functions."):
                calls.append(_call(recipient.removeprefix("functions."), body))
            elif message.channel in (None, "final"):
                content.append(body)
        return "".join(content).strip(), tuple(calls)


def _call(name: str, arguments: str | Mapping[str, Any]) -> ToolCall:
    """A parsed call, or one with ``error`` when its arguments are not a JSON object."""
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
    except ValueError as error:
        return ToolCall(name=name, arguments={}, error=f"malformed tool call arguments: {error}")
    if not isinstance(parsed, dict):
        return ToolCall(
            name=name,
            arguments={},
            error=f"malformed tool call: arguments must be a JSON object, got {arguments!r}",
        )
    return ToolCall(name=name, arguments=parsed)


# --------------------------------------------------------------------- prefix preservation

PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "the first"},
                "b": {"type": "integer", "description": "the second"},
            },
            "required": ["a", "b"],
        },
    },
}
"""The tool of the probe conversation."""

PROBE_CONVERSATION: tuple[dict[str, Any], ...] = (
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should add them.",
        "tool_calls": [
            {
                "id": "call00000",  # as the tool loop numbers them (tool_call_id)
                "type": "function",
                "function": {"name": "add", "arguments": {"a": 2, "b": 3}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call00000", "name": "add", "content": "5"},
    {"role": "assistant", "content": "5", "reasoning_content": "The tool said 5."},
)
"""A tool round as the tool loop builds it: user, assistant with a tool call (and reasoning),
the tool's answer, the assistant's answer."""

PROBE_CONVERSATIONS: tuple[tuple[str, tuple[dict[str, Any], ...]], ...] = (
    ("with reasoning", PROBE_CONVERSATION),
    (
        "without reasoning",
        tuple(
            {k: v for k, v in message.items() if k != "reasoning_content"}
            for message in PROBE_CONVERSATION
        ),
    ),
)
"""The probes, named: :data:`PROBE_CONVERSATION`, and the same turns without reasoning (Qwen3's
template writes an empty reasoning block in the last turn only)."""


def _with_string_arguments(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each tool call's arguments as their JSON text."""
    changed = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {
                    **call,
                    "function": {
                        **call["function"],
                        "arguments": json.dumps(call["function"]["arguments"]),
                    },
                }
                for call in message["tool_calls"]
            ]
        changed.append(message)
    return changed


def _renders_deepseek_v31(tokenizer: Any) -> bool:
    """The DeepSeek template writes a call as V3.1 does (the name right after the call's
    begin token, no ``function`` type and no json code block)."""
    probe = list(PROBE_CONVERSATION[:2])
    if template_takes_string_arguments(tokenizer):
        probe = _with_string_arguments(probe)
    try:
        text = tokenizer.apply_chat_template(probe, tools=[PROBE_TOOL], tokenize=False)
    except Exception:  # jinja's errors: not a template that renders this probe
        return False
    return "<｜tool▁call▁begin｜>add<｜tool▁sep｜>" in text


def template_takes_string_arguments(
    tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None
) -> bool:
    """Whether the chat template writes a tool call's arguments as a string it is given
    (DeepSeek-V3's concatenates them into its json block) rather than serialising a dict
    itself, as most do: True when the probe's tool call renders with its arguments as JSON
    text and not as a dict. The tool loop then gives the template the text
    (:func:`~asyncgrpo.adapters.models.chat.assistant_message`)."""

    def renders(messages: Sequence[Mapping[str, Any]]) -> bool:
        try:
            tokenizer.apply_chat_template(
                list(messages),
                tools=[PROBE_TOOL],
                tokenize=False,
                add_generation_prompt=False,
                **dict(chat_template_kwargs or {}),
            )
        except Exception:  # jinja's errors: this form is not the template's
            return False
        return True

    probe = PROBE_CONVERSATION[:2]
    return not renders(probe) and renders(_with_string_arguments(probe))


def check_prefix_preserving(
    tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None
) -> None:
    """Refuse a chat template that re-renders earlier turns when a message is added.

    The tool loop renders the whole conversation every turn and trains each reply's tokens as
    they were sampled; TRL's AsyncGRPOTrainer documentation asks for a prefix-preserving
    template: adding a message must not change how the earlier ones render (Qwen3's template,
    for one, drops earlier turns' reasoning). Each of :data:`PROBE_CONVERSATIONS` is rendered
    after each of its messages, with ``chat_template_kwargs`` (``AsyncGRPOConfig``'s).

    Raises:
        ValueError: naming the template, the message whose addition changed the text, and the
            first characters that differ; or the template's error when it cannot render the
            probe.
    """

    as_string = template_takes_string_arguments(tokenizer, chat_template_kwargs)

    def render(messages: Sequence[Mapping[str, Any]]) -> str:
        try:
            return tokenizer.apply_chat_template(
                _with_string_arguments(messages) if as_string else list(messages),
                tools=[PROBE_TOOL],
                tokenize=False,
                add_generation_prompt=False,
                **dict(chat_template_kwargs or {}),
            )
        except Exception as error:  # jinja's errors: the template's, not the caller's
            raise ValueError(
                f"the chat template of {_template_name(tokenizer)!r} could not render a tool "
                f"conversation as the tool loop builds it ({type(error).__name__}: {error}); "
                "the tool loop sends tool-call arguments as a JSON object (or its JSON text, "
                "to a template that takes a string) and the tool's answer as a 'tool' message. "
                "Give the tokenizer a template that renders them"
            ) from error

    for probe_name, probe in PROBE_CONVERSATIONS:
        earlier = render(probe[:2])
        for count in range(3, len(probe) + 1):
            later = render(probe[:count])
            if not later.startswith(earlier):
                at = next(
                    (i for i, (a, b) in enumerate(zip(earlier, later, strict=False)) if a != b),
                    min(len(earlier), len(later)),
                )
                shown = max(0, at - 20)  # a little of what they share, for context
                raise ValueError(
                    f"the chat template of {_template_name(tokenizer)!r} is not "
                    f"prefix-preserving: adding a {probe[count - 1]['role']!r} message (message "
                    f"{count} of a probe tool conversation {probe_name}) changed how the earlier "
                    f"messages render at character {at}: {earlier[shown : at + 60]!r} became "
                    f"{later[shown : at + 60]!r}. The tool loop trains each reply as it was "
                    "sampled, so every turn after the first would train on text the model never "
                    "saw. Give the tokenizer a template that renders earlier turns unchanged "
                    "(for Qwen3, one that writes every turn's reasoning block, empty or not)"
                )
            earlier = later


_LAST_TURN_REASONING = re.compile(r"\{%-?\s*if loop\.last or \(not loop\.last and \w+\)\s*-?%\}")
"""Qwen3's condition on an assistant turn after the last query: write its reasoning block only
when the turn is the last message or has reasoning."""


def training_chat_template(template: str) -> str | None:
    """The training form of a Qwen3-style chat template, or None for any other template.

    Qwen3's template (and those built on it) writes an assistant turn's reasoning block, after
    the conversation's last query, only while the turn is the last message or has reasoning:
    a turn without reasoning loses its empty ``<think>`` block once a tool answer follows it.
    TRL's AsyncGRPOTrainer swaps in a patched training template for such families; this one
    writes the block for every such turn, empty or not, and changes nothing else (the first
    prompt and the generation prompt render as before).

    Example:
        >>> qwen3 = "{%- if loop.last or (not loop.last and reasoning_content) %}<think>"
        >>> training_chat_template(qwen3)
        '{%- if true %}<think>'
        >>> training_chat_template("{{ message.content }}") is None
        True
    """
    patched, count = _LAST_TURN_REASONING.subn("{%- if true %}", template)
    return patched if count else None


def check_tool_template(
    tokenizer: Any,
    tool_call_parser: str | None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> ToolCallParser:
    """The checks of a run with tools or an environment, at construction: a tool-call format
    fits the template (or is named), and the template is prefix-preserving. A Qwen3-style
    template that is not gets its training form (:func:`training_chat_template`), logged, when
    that form is.

    Raises:
        ValueError: as :class:`ToolCallParser` and :func:`check_prefix_preserving` do.
    """
    parser = ToolCallParser(tokenizer, tool_call_parser)
    parser.load()
    try:
        check_prefix_preserving(tokenizer, chat_template_kwargs)
    except ValueError:
        template = getattr(tokenizer, "chat_template", None)
        training = training_chat_template(template) if isinstance(template, str) else None
        if training is None:
            raise
        tokenizer.chat_template = training
        try:
            check_prefix_preserving(tokenizer, chat_template_kwargs)
        except ValueError:
            tokenizer.chat_template = template
            raise
        log.info(
            "chat template swapped for its training form",
            template=_template_name(tokenizer),
            reason="it wrote an assistant turn's empty reasoning block only while the turn was "
            "the last message; the training form writes it in every turn after the last query "
            "(prefix-preserving, as the tool loop needs)",
        )
    return parser
