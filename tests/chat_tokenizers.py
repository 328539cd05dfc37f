"""Small byte-level BPE tokenizers with the special tokens and chat templates of three model
families, written as a checkpoint's `tokenizer.json` + `tokenizer_config.json`.

The templates are written here in the styles of Llama 3 (BOS written by the template and by the
tokenizer's post-processor, header tokens, `<|eot_id|>`, today's date), Qwen2.5 (ChatML with a
default system prompt) and Qwen3 (ChatML, `<think>` reasoning kept only after the last user
turn, `enable_thinking`), using the Jinja features those families use (`namespace`, reversed
slices, `loop` controls, string methods, `tojson`, `strftime_now`). Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}
{{- system_message }}{{- '<|eot_id|>' }}
{%- for message in loop_messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
    {{- '\\n\\n# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and message.role == 'system' %}{%- continue %}{%- endif %}
    {%- if message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

# style -> (special tokens, non-special added tokens, bos, eos, generation-config eos, template, BOS post-processor)
STYLES: dict[str, dict[str, Any]] = {
    "llama3": {"special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|eot_id|>"],
               "added": [], "bos": "<|begin_of_text|>", "eos": "<|eot_id|>",
               "generation_eos": ["<|end_of_text|>", "<|eot_id|>"], "template": LLAMA3_TEMPLATE,
               "prepend_bos": True},
    "qwen2.5": {"special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "bos": None,
                "added": ["<tool_call>", "</tool_call>"],
                "eos": "<|im_end|>", "generation_eos": ["<|im_end|>", "<|endoftext|>"],
                "template": QWEN25_TEMPLATE, "prepend_bos": False},
    "qwen3": {"special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "added": ["<think>", "</think>", "<tool_call>", "</tool_call>"],
              "bos": None, "eos": "<|im_end|>", "generation_eos": ["<|im_end|>", "<|endoftext|>"],
              "template": QWEN3_TEMPLATE, "prepend_bos": False},
}

_CORPUS = [
    "The cat sat on the mat. The dog sat on the log. Hello, how are you today?",
    "You are a helpful assistant. Answer briefly and think step by step.",
    "What is two plus two? Four. Le chat est sur le tapis. 猫はマットの上に座った。",
    "system user assistant tool response think Qwen Alibaba Cloud Llama Today Date December",
] * 4


def build_chat_tokenizer(style: str, vocab_size: int = 400):
    """A byte-level BPE `tokenizers.Tokenizer` with `style`'s special tokens (ids from 0 up)
    and, for Llama 3, a post-processor that prepends BOS as Llama 3's does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    spec = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=spec["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    if spec["prepend_bos"]:
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_chat_tokenizer(directory: str | Path, style: str, vocab_size: int = 400) -> Path:
    """`tokenizer.json` + `tokenizer_config.json` (special tokens, chat template) of `style` in
    `directory`; returns the directory. The generation-config EOS ids are in STYLES."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    spec = STYLES[style]
    tok = build_chat_tokenizer(style, vocab_size)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": spec["bos"], "eos_token": spec["eos"],
              "pad_token": spec["special"][0] if style != "llama3" else None, "chat_template": spec["template"],
              "model_max_length": 4096, "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), "utf-8")
    return directory


def generation_eos_ids(directory: str | Path, style: str) -> list[int]:
    """The ids of `style`'s generation-config EOS tokens in the tokenizer written to `directory`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    return [tok.token_to_id(t) for t in STYLES[style]["generation_eos"]]
