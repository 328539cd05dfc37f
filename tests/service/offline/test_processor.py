"""The Ray Data processor (service/offline/processor.py): a dataset of rows in, the rows with generated
text out, run by engine actors on a local Ray; its greedy answers equal `LLM.generate` in this
process, and a row that cannot run fails the job with a message naming it.

The checks of single rows call one actor's callable in this process, without Ray.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
import ray

from model.llm import LLM
from model.sampling.params import SamplingParams
from service.offline.processor import GenerateBatch, ProcessorConfig, build_processor
from tests.support.requirements import need_module
from tests.support.tiny_models import torch_threads

transformers = need_module("transformers")

# Ray gives an actor with half a CPU one torch thread: the in-process references run on one too,
# so that the two processes sum floats alike.
ACTOR_CPUS = 0.5
ENGINE = {"max_num_seqs": 8}
GREEDY = {"max_tokens": 8, "temperature": 0.0}
PROMPTS = ["The cat sat", "Attention is all you need", "Le chat", "In the beginning there was a token"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The dog sat on the log."}],
]
MAX_MODEL_LEN = 1024  # the tiny Qwen3's max_position_embeddings (tests/support/chat_tokenizers.py)


@pytest.fixture(scope="module")
def actor(model_dir: str) -> GenerateBatch:
    """One engine actor's callable, in this process."""
    return GenerateBatch(_config(model_dir))


def _config(model_dir: str, **changes: Any) -> ProcessorConfig:
    return ProcessorConfig(model=model_dir, engine_kwargs=ENGINE, num_cpus=ACTOR_CPUS, **changes)


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows as Ray Data hands them over: an Arrow table with every row's columns (None where a row has none)."""
    names = list(dict.fromkeys(name for row in rows for name in row))
    return pa.Table.from_pydict({name: [row.get(name) for row in rows] for name in names})


def _chat_ids(model_dir: str, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt ids transformers' `apply_chat_template` gives `messages`."""
    out = transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ---- on a local Ray (slow: each test starts engine actors) -------------------------------------

@pytest.mark.slow
def test_prompts_and_messages_are_answered_as_llm_generate_answers_them(local_ray: None, model_dir: str) -> None:
    items = ([{"id": i, "prompt": p, "messages": None} for i, p in enumerate(PROMPTS)]
             + [{"id": len(PROMPTS) + j, "prompt": None, "messages": m} for j, m in enumerate(CONVERSATIONS)])

    def preprocess(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "sampling_params": GREEDY}

    def postprocess(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "answer": f"#{row['id']}: {row['generated_text']}"}

    processor = build_processor(_config(model_dir, batch_size=len(items)), preprocess, postprocess)
    rows = sorted(processor(ray.data.from_items(items)).take_all(), key=lambda row: row["id"])

    with torch_threads(1):
        want = LLM(model_dir, **ENGINE).generate(
            [*PROMPTS, *(_chat_ids(model_dir, m) for m in CONVERSATIONS)], SamplingParams(**GREEDY))
    assert [row["id"] for row in rows] == [item["id"] for item in items]
    for row, item, out in zip(rows, items, want, strict=True):
        assert (row["prompt"], row["messages"], row["sampling_params"]) == (item["prompt"], item["messages"], GREEDY)
        assert type(row["generated_tokens"]) is list
        assert row["generated_tokens"] == out.token_ids, row["id"]
        assert row["generated_text"] == out.text
        assert row["finish_reason"] == out.finish_reason
        assert (row["num_input_tokens"], row["num_generated_tokens"]) == (len(out.prompt_token_ids), len(out.token_ids))
        assert row["answer"] == f"#{row['id']}: {out.text}"


@pytest.mark.slow
def test_two_actors_answer_every_row_once(local_ray: None, model_dir: str) -> None:
    items = [{"id": i, "prompt": list(range(1 + i, 4 + 2 * i))} for i in range(11)]  # token ids, 3 to 13 of them

    def preprocess(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "sampling_params": {"max_tokens": 2 + row["id"] % 3, "temperature": 0.0, "ignore_eos": True}}

    processor = build_processor(_config(model_dir, concurrency=2, batch_size=3), preprocess)
    rows = sorted(processor(ray.data.from_items(items)).take_all(), key=lambda row: row["id"])

    assert [row["id"] for row in rows] == list(range(len(items)))
    for row, item in zip(rows, items, strict=True):
        assert type(row["prompt"]) is list and row["prompt"] == item["prompt"]
        assert row["num_input_tokens"] == len(item["prompt"])
        assert row["num_generated_tokens"] == len(row["generated_tokens"]) == 2 + row["id"] % 3
        assert all(type(t) is int for t in row["generated_tokens"])
        assert row["finish_reason"] == "length"


@pytest.mark.slow
def test_bad_rows_fail_the_job_with_a_message_naming_them(local_ray: None, model_dir: str) -> None:
    too_long = [5] * (MAX_MODEL_LEN + 1)
    items = [{"id": 0, "prompt": [1, 2, 3]}, {"id": 1, "prompt": None}, {"id": 2, "prompt": too_long}]
    processor = build_processor(_config(model_dir))
    with pytest.raises(ray.exceptions.UserCodeException) as caught:
        processor(ray.data.from_items(items)).take_all()
    message = str(caught.value)
    assert "2 of the 3 rows of a batch cannot run, so the batch did not run" in message
    assert ("{'id': 1, 'prompt': None}: a row needs prompt (text or a list of token ids) or messages "
            "(OpenAI chat messages)") in message
    assert (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
            f"{MAX_MODEL_LEN + 1 + 16} tokens") in message
    assert "{'id': 0," not in message


# ---- one actor's rows, in this process ---------------------------------------------------------

def test_an_unknown_sampling_params_key_is_named(actor: GenerateBatch) -> None:
    with pytest.raises(ValueError, match=r"row 0 .*: sampling_params has unknown key\(s\) 'max_new_tokens'; "
                                         r"it takes .*max_tokens"):
        actor(_table([{"prompt": "The cat", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}]))


@pytest.mark.parametrize("row, problem", [
    ({"prompt": None, "messages": None}, "a row needs prompt (text or a list of token ids) or messages"),
    ({"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, "a row takes prompt or messages, not both"),
    ({"prompt": 7}, "prompt must be a string or a list of token ids, got 7"),
    ({"prompt": []}, "prompt must not be empty"),
    ({"prompt": [1, 10**6]}, "token id 1000000 in prompt is outside the vocabulary"),
    ({"prompt": "Hi", "sampling_params": {"max_tokens": 0}}, "sampling_params: max_tokens must be >= 1, got 0"),
    ({"prompt": "Hi", "sampling_params": {"max_tokens": MAX_MODEL_LEN}}, "maximum context length"),
    ({"prompt": "Hi", "sampling_params": {"logprobs": 2}}, "sampling_params logprobs: the processor's rows do not"),
    ({"prompt": "Hi", "sampling_params": {"regex": "("}}, "regex"),
    ({"prompt": "Hi", "sampling_params": "greedy"}, "sampling_params must be a dict of SamplingParams fields"),
    ({"messages": []}, "messages must be a non-empty list of chat messages"),
    ({"messages": [{"role": "user"}]}, "user message must have content"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0]: role must be one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0] has image_url parts; the offline processor takes text only"),
])
def test_a_bad_row_is_named_with_its_problem_and_the_actor_goes_on(actor: GenerateBatch, row: dict[str, Any],
                                                                  problem: str) -> None:
    # Rows as `preprocess` may give them: plain Python values, not all of them Arrow's.
    good = {"prompt": "The cat", "sampling_params": {"max_tokens": 2, "ignore_eos": True}}
    with pytest.raises(ValueError, match=r"^1 of the 2 rows of a batch cannot run") as caught:
        actor.requests([good, row])
    first, named = str(caught.value).splitlines()
    assert named.startswith("row 1 {") and problem in named, named
    answered = actor(_table([good]))
    assert answered["num_generated_tokens"] == [2]


def test_a_sampling_params_key_set_to_none_is_not_given(actor: GenerateBatch) -> None:
    # Arrow gives both rows both keys: {"max_tokens": 3, "temperature": None} and {"max_tokens": None, ...}.
    answered = actor(_table([{"prompt": "The cat", "sampling_params": {"max_tokens": 3, "ignore_eos": True}},
                             {"prompt": "Le chat", "sampling_params": {"temperature": 0.0, "ignore_eos": True}}]))
    assert answered["sampling_params"][0]["temperature"] is None
    assert answered["num_generated_tokens"] == [3, SamplingParams().max_tokens]


def test_the_config_is_checked_on_the_driver() -> None:
    with pytest.raises(ValueError, match=r"engine_kwargs has unknown field\(s\) max_seqs; it takes .*max_num_seqs"):
        ProcessorConfig(model="transformer-base", engine_kwargs={"max_seqs": 4})
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        ProcessorConfig(model="transformer-base", engine_kwargs={"max_num_seqs": 0})
    with pytest.raises(ValueError, match="concurrency must be an integer >= 1, got 0"):
        ProcessorConfig(model="transformer-base", concurrency=0)
    with pytest.raises(ValueError, match="num_gpus must be a number >= 0, got -1"):
        ProcessorConfig(model="transformer-base", num_gpus=-1)
