"""Every script in examples/ runs as a user runs it: a subprocess from the repository root, and
what it prints is checked against what the engine or the service answers the test itself.

- offline_generate.py: the same greedy text as `LLM(...).generate` in this process (one torch
  thread on both sides, so the float sums agree to the last bit).
- The HTTP scripts run against the service on the suite's shared Ray + Serve, one app at a time:
  a tiny random Qwen3-style chat model (Hermes tool calls, `<think>` reasoning: what the text
  scripts need), then a tiny random Qwen2-VL for the image script. The scripts are greedy, so
  what they print equals the answer to the same request sent here.
"""

from __future__ import annotations

import base64
import json
import os
import runpy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.chat_tokenizers import write_tiny_qwen3_chat
from tests.support.local_serve import SharedServe
from tests.support.tiny_models import torch_threads
from tests.support.vision_models import save_tiny_qwen2_vl

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TEXT_MODEL, VISION_MODEL = "tiny-qwen3", "tiny-vl"
VOCAB = 400
HIDDEN_SIZE = 64  # write_tiny_llama's width: the embedding's length
APP = {"max_num_seqs": 8, "num_kv_blocks": 256, "engine_num_cpus": 1}


def run_example(name: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """`python examples/<name> args...` from the repository root, as the docs run it; with `ok`,
    it must exit 0."""
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    if ok:
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def example_globals(name: str) -> dict[str, Any]:
    """The script's module-level names (its schema, its tools), without running its main."""
    return runpy.run_path(str(EXAMPLES / name))


def test_every_example_is_a_documented_command() -> None:
    """Each script says what it shows and how to run it, and is run by a test of this module."""
    tested = {"offline_generate.py", "openai_client.py", "streaming.py", "tool_calls.py", "structured_output.py",
              "embeddings.py", "images.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested
    for name in tested:
        proc = run_example(name, "--help")
        doc = example_globals(name)["__doc__"]
        assert f"examples/{name}" in doc and doc.split("\n\n")[0].replace("\n", " ") in " ".join(proc.stdout.split())


def test_offline_generate_prints_what_llm_generates() -> None:
    from model import LLM, SamplingParams

    prompts, max_tokens = ["Return the number of", "The default value is"], 24
    proc = run_example("offline_generate.py", "--prompt", prompts[0], "--prompt", prompts[1],
                       "--max-tokens", str(max_tokens), "--device", "cpu")
    with torch_threads(1):  # the script's thread count (OMP_NUM_THREADS=1)
        outs = LLM("transformer-base-trained", device="cpu").generate(
            prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    want = []
    for prompt, out in zip(prompts, outs):
        want += [f"prompt: {prompt!r}",
                 f"output: {out.text!r} ({len(out.token_ids)} tokens, finish_reason={out.finish_reason})"]
    assert proc.stdout.splitlines() == want
    assert all(out.text for out in outs)


# ---- the text model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 with the Qwen3-style chat template: Hermes calls, `<think>` reasoning."""
    directory = tmp_path_factory.mktemp("qwen3") / "tiny"
    write_tiny_qwen3_chat(directory, VOCAB)
    assert json.loads((directory / "config.json").read_text())["hidden_size"] == HIDDEN_SIZE
    return directory


@pytest.fixture(scope="class")
def text_url(qwen3_dir: Path, shared_serve: SharedServe) -> Iterator[str]:
    """The text model's app, for the tests of one class (the vision model's comes after it)."""
    with shared_serve({"model": str(qwen3_dir), "served_model_name": TEXT_MODEL, **APP}) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="class")
def vision_url(tmp_path_factory: pytest.TempPathFactory, shared_serve: SharedServe) -> Iterator[str]:
    directory = save_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl") / "tiny")
    with shared_serve({"model": str(directory), "served_model_name": VISION_MODEL, **APP}) as url:
        yield f"{url}/v1"


def client_of(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


class TestTextModel:
    """The scripts for a text model, on one app that lives as long as this class's tests."""

    @pytest.fixture
    def base_url(self, text_url: str) -> str:
        return text_url

    @pytest.fixture
    def client(self, text_url: str) -> openai.OpenAI:
        return client_of(text_url)

    def test_openai_client_prints_the_served_answers(self, base_url: str, client: openai.OpenAI) -> None:
        prompt = "The cat sat on the mat."
        lines = run_example("openai_client.py", "--base-url", base_url, "--prompt", prompt,
                            "--max-tokens", "12").stdout.splitlines()
        completion = client.completions.create(model=TEXT_MODEL, prompt=prompt, max_tokens=12, temperature=0)
        chat = client.chat.completions.create(model=TEXT_MODEL, max_tokens=12, temperature=0,
                                              messages=[{"role": "user", "content": prompt}])
        assert lines[0] == f"model: {TEXT_MODEL}"  # the first model the server lists
        assert lines[1] == f"completion: {completion.choices[0].text!r}" and completion.choices[0].text
        assert lines[3] == f"chat: {chat.choices[0].message.content!r}"
        assert f"usage={completion.usage.model_dump(exclude_none=True)}" in lines[2]

    def test_streaming_prints_the_answer_and_its_usage(self, base_url: str, client: openai.OpenAI) -> None:
        prompt = "Hello, how are you today?"
        out = run_example("streaming.py", "--base-url", base_url, "--model", TEXT_MODEL, "--prompt", prompt,
                          "--max-tokens", "16").stdout
        text, usage_line = out.removesuffix("\n").rsplit("\n", 1)
        full = client.chat.completions.create(model=TEXT_MODEL, max_tokens=16, temperature=0,
                                              messages=[{"role": "user", "content": prompt}])
        assert text == (full.choices[0].message.content or "")
        assert usage_line.startswith("usage: ")
        usage = json.loads(usage_line.removeprefix("usage: "))
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: the prefix cache's
        assert [usage[k] for k in counts] == [getattr(full.usage, k) for k in counts]
        assert usage["completion_tokens"] == 16

    def test_tool_loop_runs_a_forced_call_and_answers(self, base_url: str) -> None:
        proc = run_example("tool_calls.py", "--base-url", base_url, "--tool-choice", "required",
                           "--max-tokens", "96")
        tools = example_globals("tool_calls.py")["TOOLS"]
        calls = [line for line in proc.stdout.splitlines() if line.startswith("turn 1: call ")]
        assert calls, proc.stdout
        for line in calls:  # turn 1: call get_weather({...}) id=call_...
            arguments, call_id = line.removeprefix("turn 1: call get_weather(").rsplit(") id=", 1)
            jsonschema.validate(json.loads(arguments), tools[0]["function"]["parameters"])
            assert call_id.startswith("call_")
        results = [line for line in proc.stdout.splitlines() if line.startswith("turn 1: result ")]
        assert len(results) == len(calls)
        assert json.loads(results[0].removeprefix("turn 1: result "))["forecast"] == "sunny"
        assert proc.stdout.splitlines()[-1].startswith("answer: ")

    def test_tool_loop_takes_an_answer_without_a_call(self, base_url: str) -> None:
        """The default, tool_choice auto: this model answers in text, and the loop ends at once."""
        proc = run_example("tool_calls.py", "--base-url", base_url, "--max-tokens", "8")
        first, answer = proc.stdout.splitlines()
        assert first == "the model answered without calling a tool" and answer.startswith("answer: ")

    def test_structured_output_parses_against_its_schema(self, base_url: str) -> None:
        out = run_example("structured_output.py", "--base-url", base_url).stdout
        jsonschema.validate(json.loads(out), example_globals("structured_output.py")["SCHEMA"])

    def test_embeddings_prints_vectors_of_the_model_width(self, base_url: str) -> None:
        texts = ["The cat sat on the mat.", "The cat sat on the mat.", "What is two plus two?"]
        lines = run_example("embeddings.py", "--base-url", base_url, *(a for t in texts for a in ("--text", t))
                            ).stdout.splitlines()
        assert lines[0].startswith(f"3 vectors of length {HIDDEN_SIZE}, ")
        assert lines[4] == "cosine(text 0, text 1) = 1.0000"  # the same text, the same vector
        assert lines[5].startswith("cosine(text 0, text 2) = ") and lines[5] != "cosine(text 0, text 2) = 1.0000"

    def test_images_against_a_text_model_fails_with_a_clear_message(self, base_url: str) -> None:
        proc = run_example("images.py", "--base-url", base_url, ok=False)
        assert proc.returncode == 1 and proc.stdout == ""
        assert f"model '{TEXT_MODEL}' does not take images" in proc.stderr
        assert "needs a vision-language model" in proc.stderr and "Traceback" not in proc.stderr


# ---- the vision model -------------------------------------------------------------------------

class TestVisionModel:
    """images.py against a vision-language model; its own app, after the text model's."""

    def test_images_sends_a_picture_the_model_sees(self, vision_url: str) -> None:
        lines = run_example("images.py", "--base-url", vision_url, "--max-tokens", "8").stdout.splitlines()
        client = client_of(vision_url)
        url = "data:image/png;base64," + base64.b64encode(example_globals("images.py")["drawn_png"]()).decode()
        question = {"type": "text", "text": "What is in this picture?"}
        seen = client.chat.completions.create(model=VISION_MODEL, max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [question, {"type": "image_url", "image_url": {"url": url}}]}])
        blind = client.chat.completions.create(model=VISION_MODEL, max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": [question]}])
        assert lines == [f"answer: {seen.choices[0].message.content!r}",
                         f"usage: prompt_tokens={seen.usage.prompt_tokens} "
                         f"completion_tokens={seen.usage.completion_tokens}"]
        # 112 x 84 pixels: 8 x 6 patches of 14, merged 2 x 2 into 12 image tokens, between
        # <|vision_start|> and <|vision_end|>.
        assert seen.usage.prompt_tokens - blind.usage.prompt_tokens == 12 + 2
