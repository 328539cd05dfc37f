"""A completion and a chat completion with the official `openai` client against a running server.

Start the server first (`make serve` serves `transformer-base-trained` on port 8000), then:

    .venv/bin/python examples/openai_client.py
    .venv/bin/python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --model transformer-base-trained

Without `--model`, the script uses the first model the server lists (`GET /v1/models`). The
requests are greedy (temperature 0), so the same server gives the same text every run. The
client needs some API key; the server ignores it unless it was started with one (`QKV_API_KEY`).
"""

from __future__ import annotations

import argparse
import os
import sys

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--model", help="the served model name; default: the first one the server lists")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    parser.add_argument("--prompt", default="Return the number of")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = args.model or client.models.list().data[0].id
    print(f"model: {model}")

    # /v1/completions: the model continues the prompt as it is.
    completion = client.completions.create(model=model, prompt=args.prompt, max_tokens=args.max_tokens,
                                           temperature=0)
    usage = completion.usage.model_dump(exclude_none=True)
    print(f"completion: {completion.choices[0].text!r}")
    print(f"  finish_reason={completion.choices[0].finish_reason} usage={usage}")

    # /v1/chat/completions: the server renders the messages with the model's chat template.
    chat = client.chat.completions.create(model=model, max_tokens=args.max_tokens, temperature=0,
                                          messages=[{"role": "user", "content": args.prompt}])
    print(f"chat: {chat.choices[0].message.content!r}")
    print(f"  finish_reason={chat.choices[0].finish_reason} usage={chat.usage.model_dump(exclude_none=True)}")


if __name__ == "__main__":
    try:
        main()
    except openai.APIError as e:  # the server's error message, or why it could not be reached
        sys.exit(f"error: {e} ({e.request.method} {e.request.url})")
