"""A Qwen2.5-style tokenizer built from GGUF-shaped metadata, with no download: the byte-level alphabet as its
vocabulary (no merges), then Qwen2.5's 22 special tokens in their order (ids 256.. here, 151643.. in Qwen2.5),
with their GGUF token types, the `qwen2` pre-tokenizer and Qwen2.5's chat template."""

from __future__ import annotations

from pathlib import Path

from hafiza.models.tokenizer import Tokenizer, tokenizer_from_gguf

FIRST_SPECIAL_ID = 256
# Qwen2.5's added tokens in id order.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
USER_DEFINED = ("<tool_call>", "</tool_call>")  # llama.cpp's converter: every other one "looks special" (CONTROL)

# Qwen2.5-Instruct's chat template.
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within " }}
    {{- "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, " }}
    {{- "\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (what byte-level BPE vocabularies are made of)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def qwen25_tokenizer() -> Tokenizer:
    """The tokenizer hafiza builds from a Qwen2.5 GGUF's metadata, on a byte-only vocabulary."""
    alphabet = _byte_alphabet()
    tokens = alphabet + SPECIAL_TOKENS
    types = [1] * FIRST_SPECIAL_ID + [4 if t in USER_DEFINED else 3 for t in SPECIAL_TOKENS]
    fields = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": FIRST_SPECIAL_ID + 2, "tokenizer.ggml.bos_token_id": FIRST_SPECIAL_ID,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    return tokenizer_from_gguf(fields, Path("qwen2.5-style.gguf"))
