"""Write a prompt file for GuideLLM (`--data kind=json_file,path=...`): one JSON object a line,
`prompt` and `output_tokens_count`, prompts made from the same word list as the Locust scenarios.

    .venv/bin/python loadtests/tools/guidellm_data.py --out reports/guidellm_prompts.jsonl

A file instead of GuideLLM's synthetic data, which needs a Hugging Face tokenizer to size its
prompts (downloaded unless given as a local directory); the service counts the tokens itself.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.openai_workload import make_prompt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the .jsonl file to write")
    parser.add_argument("--requests", type=int, default=512, help="prompts in the file (GuideLLM cycles them)")
    parser.add_argument("--prompt-words", type=int, default=12, help="words per prompt (~6 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens asked of each request")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for _ in range(args.requests):
            f.write(json.dumps({"prompt": make_prompt(rng, args.prompt_words),
                                "output_tokens_count": args.max_tokens}) + "\n")
    print(f"wrote {args.requests} prompts to {args.out}")


if __name__ == "__main__":
    main()
