"""A streamed chat completion: print the text as it arrives, then the token counts.

With `stream=True` the server answers with server-sent events, one `chat.completion.chunk` per
step; `stream_options={"include_usage": True}` adds a last chunk, with no choices, that carries
the request's usage. Start the server first (`make serve`), then:

    .venv/bin/python examples/streaming.py
    .venv/bin/python examples/streaming.py --base-url http://127.0.0.1:8000/v1 --prompt "Hi" --max-tokens 64

Without `--model`, the script uses the first model the server lists. A thinking model's
reasoning arrives apart, as `reasoning_content` on the deltas; this script prints the answer's
`content` only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--model", help="the served model name; default: the first one the server lists")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    parser.add_argument("--prompt", default="Return the number of")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = args.model or client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": args.prompt}],
                                            max_tokens=args.max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        if chunk.usage is not None:  # the last chunk: no choices, the whole request's counts
            usage = chunk.usage
    print()
    if usage is None:
        sys.exit("error: the stream ended without a usage chunk")
    print("usage: " + json.dumps(usage.model_dump(exclude_none=True)))


if __name__ == "__main__":
    try:
        main()
    except openai.APIError as e:  # the server's error message, or why it could not be reached
        sys.exit(f"error: {e} ({e.request.method} {e.request.url})")
