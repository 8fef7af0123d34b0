"""A tiny Qwen3 taught to answer every prompt with one of a few fixed replies.

A random tiny model never writes ``$4$`` nor calls a tool, so the rewards of TRL's
documentation examples (``accuracy_reward``, an environment's ``get_reward`` after its
``increment`` tool) would be equal across every group: each group dropped, no step ever
trained. This model, fine-tuned on the spot (a few seconds on CPU), samples its reply from
:data:`REPLIES` whatever the prompt, so the rewards differ within groups as they do with a real
model. Nothing is downloaded.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPLIES = (
    "$4$",
    "The answer is $4$.",
    "no",
    "The answer is $5$.",
    *(
        f'<tool_call>{{"name": "increment", "arguments": {{"step": {step}}}}}</tool_call>'
        for step in (1, 2, 3)
    ),
    '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 2}}</tool_call>',
)
_PROMPTS = (
    "What is 2+2?",
    "Write a function that returns the sum of two numbers.",
    "Increment the counter by 3.",
    "Increment the counter to 2.",
    "What is 3*4?",
)
_TOOLS = ({"type": "function", "function": {"name": "increment", "parameters": {}}},)


def _example(tokenizer, rng: random.Random) -> tuple[list[int], list[int]]:
    messages = [{"role": "user", "content": rng.choice(_PROMPTS)}]
    if rng.random() < 0.5:  # a turn after a tool call
        messages += [
            {"role": "assistant", "content": rng.choice(REPLIES)},
            {"role": "tool", "name": "increment", "content": str(rng.randint(1, 9))},
        ]
    tools = list(_TOOLS) if rng.random() < 0.5 else None
    prompt = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    reply = tokenizer.encode(rng.choice(REPLIES), add_special_tokens=False)
    return list(prompt), [*reply, tokenizer.eos_token_id]


def save_replying_model(base: Path, path: Path, steps: int = 150, seed: int = 0) -> Path:
    """Fine-tune the tiny model at ``base`` to reply from :data:`REPLIES`; save to ``path``."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    rng = random.Random(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(steps):
            batch = [_example(tokenizer, rng) for _ in range(16)]
            width = max(len(p) + len(r) for p, r in batch)
            ids = torch.full((len(batch), width), tokenizer.pad_token_id)
            labels = torch.full((len(batch), width), -100)
            for row, (prompt, reply) in enumerate(batch):
                tokens = torch.tensor(prompt + reply)
                ids[row, : len(tokens)] = tokens
                labels[row, len(prompt) : len(tokens)] = torch.tensor(reply)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
