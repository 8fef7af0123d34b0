"""A black-box calculator agent, run as its own process: it asks the model at
``OPENAI_BASE_URL`` (the trainer's capture endpoint) for the product in its question, with a
``multiply`` tool it runs itself, for at most two model calls, then writes how many times it
called the tool to the JSON file named by its first argument.

``CALCULATOR_AGENT_FAULT`` makes it misbehave on purpose before its first call: ``crash`` (exit
code 3) or ``hang`` (sleeps for an hour).

    python calculator_agent.py REPORT.json "What is 6*7? Use the multiply tool."
"""

from __future__ import annotations

import json
import os
import sys
import time

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "required": ["a", "b"],
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


def main() -> None:
    report, question = sys.argv[1], sys.argv[2]
    fault = os.environ.get("CALCULATOR_AGENT_FAULT")
    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key="none", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": question}]
    calls = 0
    if fault == "crash":
        sys.exit(3)
    if fault == "hang":
        time.sleep(3600)
    for _ in range(2):
        reply = client.chat.completions.create(
            model="calculator-agent", messages=messages, tools=TOOLS
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments or "{}")
            if call.function.name == "multiply" and {"a", "b"} <= set(arguments):
                calls += 1
                answer = str(int(arguments["a"]) * int(arguments["b"]))
            else:
                answer = f"Error: unknown tool {call.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    with open(report, "w") as file:
        json.dump({"multiply_calls": calls}, file)


if __name__ == "__main__":
    main()
