"""A tool loop: the model may call `get_weather`, the script runs it and sends the result back,
until the model answers in text.

Tool calls need a model trained to make them, served with a chat template the server reads calls
from, for instance Qwen3 (see docs/features/tools.md):

    .venv/bin/python -m service.launch serve run --address local service.app:build_app model=Qwen/Qwen3-0.6B max_model_len=8192
    .venv/bin/python examples/tool_calls.py --model Qwen/Qwen3-0.6B

Every call that comes back is well-formed, with arguments valid against the tool's JSON schema:
the server constrains the call while it is decoded. Whether the model calls at all is its own
choice (`tool_choice="auto"`), so the script handles both: a call runs the tool and the loop goes
on; a text answer ends it. `--tool-choice required` makes the first turn a call whatever the
model would choose (useful with a small model that never calls by itself); later turns are
`auto`, so the model can answer. The script fails when no answer comes within `--max-turns`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import openai

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}]


def get_weather(city: str, unit: str = "celsius") -> dict[str, Any]:
    """A stand-in for a real weather service: the same forecast for every city."""
    return {"city": city, "forecast": "sunny", "temperature": 22 if unit == "celsius" else 72, "unit": unit}


FUNCTIONS = {"get_weather": get_weather}


def run_tool(name: str, arguments: str) -> str:
    """The tool's result as the text of a `tool` message."""
    if name not in FUNCTIONS:
        return json.dumps({"error": f"no tool named {name!r}"})
    return json.dumps(FUNCTIONS[name](**json.loads(arguments)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--model", help="the served model name; default: the first one the server lists")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    parser.add_argument("--prompt", default="What is the weather in Paris?")
    parser.add_argument("--tool-choice", choices=["auto", "required"], default="auto",
                        help="the first turn's tool_choice (later turns: auto)")
    parser.add_argument("--max-tokens", type=int, default=512, help="per turn")
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = args.model or client.models.list().data[0].id
    messages: list[dict[str, Any]] = [{"role": "user", "content": args.prompt}]
    tool_choice = args.tool_choice
    for turn in range(1, args.max_turns + 1):
        response = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                  tool_choice=tool_choice, max_tokens=args.max_tokens,
                                                  temperature=0)
        choice = response.choices[0]
        message = choice.message
        # The assistant's turn goes back into the history as it came: calls, ids and all.
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            if turn == 1:
                print("the model answered without calling a tool")
            print(f"answer: {message.content!r} (finish_reason={choice.finish_reason})")
            return
        for call in message.tool_calls:
            print(f"turn {turn}: call {call.function.name}({call.function.arguments}) id={call.id}")
            result = run_tool(call.function.name, call.function.arguments)
            print(f"turn {turn}: result {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        tool_choice = "auto"
    sys.exit(f"error: no answer after {args.max_turns} turns; raise --max-turns")


if __name__ == "__main__":
    try:
        main()
    except openai.APIError as e:  # the server's error message, or why it could not be reached
        sys.exit(f"error: {e} ({e.request.method} {e.request.url})")
