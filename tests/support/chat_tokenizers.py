"""Small byte-level BPE tokenizers with the special tokens and chat templates of four model
families, written as a checkpoint's `tokenizer.json` + `tokenizer_config.json`.

The templates are written here in the styles of Llama 3.1 (BOS written by the template and by the
tokenizer's post-processor, header tokens, `<|eot_id|>`, today's date; tools as JSON in the first
user message, calls as `{"name", "parameters"}`, one per turn, results as `ipython` turns), Qwen2.5
(ChatML with a default system prompt; tools in a `# Tools` system block, calls in `<tool_call>`,
consecutive results in one user turn of `<tool_response>` blocks), Qwen3 (the same tool syntax,
`<think>` reasoning from `reasoning_content` or the content, kept only after the last user turn,
`enable_thinking`) and Mistral-7B-Instruct-v0.3 (`[AVAILABLE_TOOLS]` before the last user turn,
`[TOOL_CALLS]` with 9-character ids, `[TOOL_RESULTS]`), using the Jinja features those families
use (`namespace`, reversed slices, `loop` controls, string methods, `tojson`, `strftime_now`,
`raise_exception`, `selectattr`, dict `items()`). Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if builtin_tools is defined or tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}
{%- if builtin_tools is defined %}
    {{- 'Tools: ' + builtin_tools | reject('equalto', 'code_interpreter') | join(', ') + '\\n\\n' }}
{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}
{%- if tools is not none and not tools_in_user_message %}
    {{- 'You have access to the following functions. ' }}
    {{- 'To call a function, please respond with JSON for a function call.' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- 'Do not use variables.\\n\\n' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- system_message }}{{- '<|eot_id|>' }}
{%- if tools_in_user_message and tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content'] | trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
    {{- 'Given the following functions, please respond with a JSON for a function call ' }}
    {{- 'with its proper arguments that best answers the given prompt.\\n\\n' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- 'Do not use variables.\\n\\n' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
    {{- first_user_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls | length == 1 %}
            {{- raise_exception('This model only supports single tool-calls at once!') }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|python_tag|>' + tool_call.name + '.call(' }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}{{- ', ' }}{%- endif %}
            {%- endfor %}
            {{- ')' }}
        {%- else %}
            {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}' }}
        {%- endif %}
        {%- if builtin_tools is defined %}{{- '<|eom_id|>' }}{%- else %}{{- '<|eot_id|>' }}{%- endif %}
    {%- else %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
        {%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}
        {%- else %}{{- message.content }}{%- endif %}
        {{- '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# The `# Tools` system block of Qwen2.5 and Qwen3 (Qwen3 writes no default system prompt).
_QWEN_TOOLS = """
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}' }}
    {{- '\\n</tool_call><|im_end|>\\n' }}"""

# Consecutive tool results share one user turn of <tool_response> blocks.
_QWEN_TOOL_RESPONSE = """
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"""

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
    {{- '\\n\\n' }}""" + _QWEN_TOOLS + """
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first)
          or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}""" + _QWEN_TOOL_RESPONSE + """
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}""" + _QWEN_TOOLS + """
{%- elif messages[0].role == 'system' %}
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
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
            {{- content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}
            {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
            {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}""" + _QWEN_TOOL_RESPONSE + """
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

MISTRAL_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}
{#- user and assistant alternate, tool calls and their results aside #}
{%- set ns = namespace(index=0) %}
{%- for message in loop_messages %}
    {%- if not (message.role == 'tool' or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message['role'] == 'user') != (ns.index % 2 == 0) %}
            {{- raise_exception('After the optional system message, conversation roles must alternate '
                                'user/assistant/user/assistant/...') }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {%- if tools is not none and message == user_messages[-1] %}
            {{- '[AVAILABLE_TOOLS] [' }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != 'return' %}
                    {%- if val is string %}{{- '"' + key + '": "' + val + '"' }}
                    {%- else %}{{- '"' + key + '": ' + val | tojson }}{%- endif %}
                    {%- if not loop.last %}{{- ', ' }}{%- endif %}
                {%- endfor %}
                {{- '}}' }}
                {%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' }}{%- endif %}
            {%- endfor %}
            {{- '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- '[TOOL_CALLS] [' }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function | tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id | length != 9 %}
                {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] | trim + eos_token }}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | string + ', ' }}
        {%- if not message.tool_call_id is defined or message.tool_call_id | length != 9 %}
            {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, '
                            'with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# Qwen2-VL's ChatML: a content list renders text parts as they are and each image part (as HF's
# processors pass them: {"type": "image"}, or a part with an "image" / "image_url" key) as the
# vision markers around one <|image_pad|>, which the engine expands to the image's tokens.
QWEN2_VL_TEMPLATE = """{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- else %}
        {%- for part in message['content'] %}
            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'text' in part %}
                {{- part['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# style -> special tokens (ids from 0, in this order: append new ones), non-special added tokens,
# bos, eos, pad, generation-config eos, template, whether the post-processor prepends BOS, and
# (when False) that the template writes no tools
STYLES: dict[str, dict[str, Any]] = {
    "llama3": {"special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|eot_id|>", "<|python_tag|>", "<|eom_id|>"],
               "added": [], "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": None,
               "generation_eos": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "template": LLAMA3_TEMPLATE,
               "prepend_bos": True},
    "qwen2.5": {"special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "added": ["<tool_call>", "</tool_call>"],
                "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
                "generation_eos": ["<|im_end|>", "<|endoftext|>"], "template": QWEN25_TEMPLATE, "prepend_bos": False},
    "qwen3": {"special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              "added": ["<think>", "</think>", "<tool_call>", "</tool_call>"],
              "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
              "generation_eos": ["<|im_end|>", "<|endoftext|>"], "template": QWEN3_TEMPLATE, "prepend_bos": False},
    "qwen2_vl": {"special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                             "<|image_pad|>", "<|video_pad|>"], "added": [],
                 "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
                 "generation_eos": ["<|im_end|>", "<|endoftext|>"], "template": QWEN2_VL_TEMPLATE,
                 "prepend_bos": False, "tools": False},  # Qwen2-VL's template has no tools
    "mistral": {"special": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                "added": [], "bos": "<s>", "eos": "</s>", "pad": None, "generation_eos": ["</s>"],
                "template": MISTRAL_TEMPLATE, "prepend_bos": True},
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
              "pad_token": spec["pad"], "chat_template": spec["template"],
              "model_max_length": 4096, "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), "utf-8")
    return directory


def generation_eos_ids(directory: str | Path, style: str) -> list[int]:
    """The ids of `style`'s generation-config EOS tokens in the tokenizer written to `directory`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    return [tok.token_to_id(t) for t in STYLES[style]["generation_eos"]]


def write_tiny_qwen3_chat(directory: str | Path, vocab_size: int = 400) -> Path:
    """A tiny random Qwen3 with the Qwen3-style chat tokenizer and template (Hermes tool calls,
    `<think>` reasoning) and its generation config's EOS ids."""
    from tests.support.tiny_models import write_tiny_llama  # torch: only for the callers that build a model

    directory = Path(directory)
    write_chat_tokenizer(directory, "qwen3", vocab_size=vocab_size)
    eos = generation_eos_ids(directory, "qwen3")
    write_tiny_llama(directory, arch="qwen3", with_tokenizer=False, vocab_size=vocab_size + 8,
                     max_position_embeddings=1024, eos_token_id=eos[0], head_dim=16)
    write_chat_tokenizer(directory, "qwen3", vocab_size=vocab_size)  # save_pretrained leaves the tokenizer alone
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory
