"""Structured output: the answer is JSON that fits a JSON schema, because the server constrains
every token to it (`response_format` of type `json_schema`).

Start the server first (`make serve`), then:

    .venv/bin/python examples/structured_output.py
    .venv/bin/python examples/structured_output.py --base-url http://127.0.0.1:8000/v1 --model transformer-base-trained

The script parses the answer with `json.loads` and prints it. The schema holds whatever model
answers; what is in the fields is the model's (a small model writes little sense in them). An
answer cut by `max_tokens` is not complete JSON: the script then fails and says so. See
docs/features/structured-outputs.md for regexes, choices and grammars.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import openai

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["python", "c", "rust", "go"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--model", help="the served model name; default: the first one the server lists")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    parser.add_argument("--prompt", default="Describe a programmer as JSON: name, age, languages.")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = args.model or client.models.list().data[0].id
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "programmer", "schema": SCHEMA,
                                                                "strict": True}})
    choice = response.choices[0]
    if choice.finish_reason == "length":
        sys.exit(f"error: the answer was cut at {args.max_tokens} tokens, before its JSON ended; "
                 f"raise --max-tokens (got {choice.message.content!r})")
    person = json.loads(choice.message.content)
    print(json.dumps(person))


if __name__ == "__main__":
    try:
        main()
    except openai.APIError as e:  # the server's error message, or why it could not be reached
        sys.exit(f"error: {e} ({e.request.method} {e.request.url})")
