"""Offline generation: the engine in your own Python process, no server.

Loads the shipped default model, `transformer-base-trained` (the paper's base Transformer trained
on the Python standard library's documentation, in model/weights/), and continues a few prompts
greedily (temperature 0, so the same prompts give the same text every run). Prints each prompt
and its continuation.

Run it from the repository root, after `make install`:

    .venv/bin/python examples/offline_generate.py
    .venv/bin/python examples/offline_generate.py --prompt "Return the number of" --max-tokens 48

`--model` takes any preset name, checkpoint directory or Hugging Face hub id that `LLM` loads.
"""

from __future__ import annotations

import argparse

from model import LLM, SamplingParams

PROMPTS = ["Return the number of", "Open the file and", "If the optional argument"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="transformer-base-trained",
                        help="a preset name, a checkpoint directory or an HF hub id")
    parser.add_argument("--prompt", action="append", dest="prompts",
                        help="a prompt to continue (repeat for several); default: three built-in ones")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per prompt")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    args = parser.parse_args()

    llm = LLM(args.model, device=args.device)
    prompts = args.prompts or PROMPTS
    # temperature 0 is greedy decoding: the most likely token at every step.
    outputs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    for prompt, out in zip(prompts, outputs):
        # repr() keeps each text on one line, whatever newlines the model writes.
        print(f"prompt: {prompt!r}")
        print(f"output: {out.text!r} ({len(out.token_ids)} tokens, finish_reason={out.finish_reason})")


if __name__ == "__main__":
    main()
