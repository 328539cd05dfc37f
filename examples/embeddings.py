"""Embeddings: `/v1/embeddings` with the official `openai` client, and the cosine similarity of
the vectors.

The server embeds with the served checkpoint, pooled as its sentence-transformers files say (a
plain causal LM: its last token's hidden state). Serve an embedding model for vectors worth
comparing (see docs/features/apis.md), though any served model answers:

    .venv/bin/python -m service.launch serve run --address local service.app:build_app model=Qwen/Qwen3-Embedding-0.6B
    .venv/bin/python examples/embeddings.py --model Qwen/Qwen3-Embedding-0.6B

Without `--model`, the script uses the first model the server lists.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import openai

TEXTS = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Stock prices fell sharply today."]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--model", help="the served model name; default: the first one the server lists")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    parser.add_argument("--text", action="append", dest="texts", help="a text to embed (repeat for several)")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = args.model or client.models.list().data[0].id
    texts = args.texts or TEXTS
    response = client.embeddings.create(model=model, input=texts)
    vectors = [d.embedding for d in sorted(response.data, key=lambda d: d.index)]
    print(f"{len(vectors)} vectors of length {len(vectors[0])}, {response.usage.prompt_tokens} prompt tokens")
    for text, vector in zip(texts, vectors):
        print(f"{text!r}: [{', '.join(f'{x:.4f}' for x in vector[:4])}, ...]")
    for i in range(1, len(vectors)):
        print(f"cosine(text 0, text {i}) = {cosine(vectors[0], vectors[i]):.4f}")


if __name__ == "__main__":
    try:
        main()
    except openai.APIError as e:  # the server's error message, or why it could not be reached
        sys.exit(f"error: {e} ({e.request.method} {e.request.url})")
