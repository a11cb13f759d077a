"""The chat format a model file without a template gets: its family's own published format,
chosen by the architecture (and, for Llama-architecture files, by the vocabulary's markers),
written as llama.cpp's built-in formats write it (``src/llama-chat.cpp``).

None of them writes BOS: the prompt's tokenisation adds it where the file says so, as
llama.cpp's does.
"""

from __future__ import annotations

from collections.abc import Collection

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA = (
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{% set ns.system = ns.system + m.content | trim %}"
    "{% else %}{% set role = 'model' if m.role == 'assistant' else m.role %}"
    "<start_of_turn>{{ role }}\n"
    "{% if ns.system and role != 'model' %}{{ ns.system }}\n\n{% set ns.system = '' %}{% endif %}"
    "{{ m.content | trim }}<end_of_turn>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA3 = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA2 = (
    "[INST] {% set ns = namespace(inside=true) %}"
    "{% for m in messages %}"
    "{% if not ns.inside %}[INST] {% set ns.inside = true %}{% endif %}"
    "{% if m.role == 'system' %}<<SYS>>\n{{ m.content }}\n<</SYS>>\n\n"
    "{% elif m.role == 'user' %}{{ m.content }} [/INST]"
    "{% else %}{{ m.content }}</s>{% set ns.inside = false %}{% endif %}"
    "{% endfor %}"
)
MISTRAL_V7 = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}[SYSTEM_PROMPT] {{ m.content }}[/SYSTEM_PROMPT]"
    "{% elif m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    "{% else %} {{ m.content }}</s>{% endif %}"
    "{% endfor %}"
)
DEEPSEEK3 = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content }}\n\n"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
DEEPSEEK2 = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content }}\n\n"
    "{% elif m.role == 'user' %}User: {{ m.content }}\n\n"
    "{% elif m.role == 'assistant' %}Assistant: {{ m.content }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
GLM4 = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PHI3 = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
HARMONY = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}"
    "{{ '<|return|>' if m.role == 'assistant' else '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

FORMATS: dict[str, str] = {
    "chatml": CHATML,
    "gemma": GEMMA,
    "llama3": LLAMA3,
    "llama2": LLAMA2,
    "mistral-v7": MISTRAL_V7,
    "deepseek3": DEEPSEEK3,
    "deepseek2": DEEPSEEK2,
    "glm4": GLM4,
    "phi3": PHI3,
    "gpt-oss": HARMONY,
}

# architecture (GGUF ``general.architecture`` or a folder's ``model_type``) -> format
BY_ARCHITECTURE: dict[str, str] = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3_text": "gemma",
    "qwen2": "chatml",
    "qwen2moe": "chatml",
    "qwen2_moe": "chatml",
    "qwen3": "chatml",
    "qwen3moe": "chatml",
    "qwen3_moe": "chatml",
    "mistral": "mistral-v7",
    "mixtral": "mistral-v7",
    "glm4moe": "glm4",
    "glm4_moe": "glm4",
    "phi3": "phi3",
    "gpt-oss": "gpt-oss",
    "gpt_oss": "gpt-oss",
}


def family_format(architecture: str, tokens: Collection[str]) -> str:
    """The format's name for a file of ``architecture`` whose vocabulary holds ``tokens``;
    where neither tells, ChatML (llama.cpp's own fallback)."""
    if architecture in BY_ARCHITECTURE:
        return BY_ARCHITECTURE[architecture]
    if architecture.startswith("deepseek"):
        return "deepseek3" if "<｜User｜>" in tokens else "deepseek2"
    if architecture == "llama":
        if "<|start_header_id|>" in tokens:
            return "llama3"
        if "<|im_start|>" in tokens:
            return "chatml"
        if "[INST]" in tokens:
            return "mistral-v7"
        return "llama2"
    return "chatml"
