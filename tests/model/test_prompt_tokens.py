"""A prompt's ids begin and end as llama.cpp makes them, on llama.cpp's own vocabulary files:
BOS by the file's ``add_bos_token`` (true, false, or llama.cpp's default for the vocabulary
where the key is absent), EOS by ``add_eos_token``, never a second BOS where the template
writes one, a missing template replaced by the family's format, bad ids refused up front."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from seamline.errors import CheckpointError, RequestError
from seamline.text import TextCodec
from tests.support.llama_cpp import gemma3_270m
from tests.support.vocab_files import ABSENT, vocab_copy, vocab_file

ADD_BOS, ADD_EOS = "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"
TEMPLATE = "tokenizer.chat_template"

# vocabulary, add_bos_token as written, whether BOS comes first, BOS id
BOS_CASES = [
    ("llama-spm", True, True, 1),
    ("llama-spm", False, False, 1),
    ("llama-spm", ABSENT, True, 1),  # SentencePiece: llama.cpp adds BOS by default
    ("gpt-2", True, True, 50256),
    ("gpt-2", False, False, 50256),
    ("gpt-2", ABSENT, False, 50256),  # byte-level BPE: not by default
    ("llama-bpe", ABSENT, True, 128000),  # ... except after Llama 3's pre-tokenizer
]


def _codec(tmp_path: Path, vocab: str, overrides: dict[str, Any]) -> TextCodec:
    """The vocabulary's file as llama.cpp ships it, or a copy with ``overrides``."""
    if not overrides:
        return TextCodec.from_model(vocab_file(vocab))
    return TextCodec.from_model(vocab_copy(vocab, tmp_path / f"{vocab}.gguf", overrides))


@pytest.mark.parametrize(("vocab", "flag", "first", "bos"), BOS_CASES)
def test_bos_follows_the_files_key(
    tmp_path: Path, vocab: str, flag: Any, first: bool, bos: int
) -> None:
    unchanged = flag is ABSENT and vocab in ("gpt-2", "llama-bpe")  # their files have no such key
    codec = _codec(tmp_path, vocab, {} if unchanged else {ADD_BOS: flag})
    text = codec.encode("Hello world")
    assert text and text[0] != bos
    assert codec.encode_prompt("Hello world") == ([bos] if first else []) + text
    chat = codec.encode_chat([{"role": "user", "content": "Hello world"}])
    assert (chat[0] == bos) is first and chat.count(bos) <= 1


def test_eos_follows_the_files_key(tmp_path: Path) -> None:
    codec = _codec(tmp_path, "llama-spm", {ADD_EOS: True})
    ids = codec.encode_prompt("Hello world")
    assert ids[0] == 1 and ids[-1] == 2 and ids[1:-1] == codec.encode("Hello world")


@pytest.mark.parametrize("flag", [True, False])
def test_a_template_that_writes_bos_gives_one_bos(tmp_path: Path, flag: bool) -> None:
    """llama.cpp drops the template's own BOS text where it adds BOS; where it does not, the
    BOS text is a special token the prompt's text holds: one BOS either way."""
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    codec = _codec(tmp_path, "llama-spm", {ADD_BOS: flag, TEMPLATE: template})
    ids = codec.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(1) == 1
    assert codec.decode(ids[1:], special=True) == "[user] Hi\n"


def test_a_file_without_a_template_gets_its_familys_format(tmp_path: Path) -> None:
    codec = _codec(tmp_path, "llama-bpe", {})
    text = codec.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert codec.template_note is not None and "llama3" in codec.template_note
    assert codec.encode_chat([{"role": "user", "content": "Hi"}])[:2] == [128000, 128006]


def test_the_real_gemma_file_puts_bos_first() -> None:
    """The base Gemma 3 270M from llama.cpp's converter says add_bos_token = true and has no
    template: BOS (2) first, the chat in Gemma's turns, ended at ``<end_of_turn>``."""
    codec = TextCodec.from_model(gemma3_270m())
    assert codec.encode_prompt("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert codec.render_chat(chat) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = codec.encode_chat(chat)
    assert ids[:2] == [2, 105] and ids.count(2) == 1
    assert codec.tokenizer.token_to_id("<end_of_turn>") in codec.stop_ids


def test_a_bos_id_past_the_vocabulary_is_refused(tmp_path: Path) -> None:
    path = vocab_copy("llama-spm", tmp_path / "bad.gguf", {"tokenizer.ggml.bos_token_id": 40000})
    with pytest.raises(CheckpointError) as caught:
        TextCodec.from_model(path)
    message = str(caught.value)
    assert str(path) in message and "tokenizer.ggml.bos_token_id" in message and "40000" in message
    assert "\n" not in message


def test_a_template_that_fails_to_render_names_its_error(tmp_path: Path) -> None:
    codec = _codec(tmp_path, "llama-spm", {TEMPLATE: "{{ messages[0].content | nosuchfilter }}"})
    with pytest.raises(RequestError, match="nosuchfilter"):
        codec.render_chat([{"role": "user", "content": "Hi"}])


def _folder(tmp_path: Path, bos_first: bool) -> Path:
    """A folder with the embedded model's vocabulary, whose post-processor puts BOS first or
    not, and whose template writes BOS itself."""
    from tokenizers import processors

    from seamline.app import default_model_path
    from seamline.weights.gguf import tokenizer_from_gguf

    folder = tmp_path / f"folder-{bos_first}"
    folder.mkdir()
    tokenizer = tokenizer_from_gguf(default_model_path())
    if bos_first:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
        )
    tokenizer.save(str(folder / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


@pytest.mark.parametrize("bos_first", [True, False])
def test_a_folders_prompt_is_what_transformers_makes(tmp_path: Path, bos_first: bool) -> None:
    """Raw prompts by the post-processor, chats as the template wrote them: transformers' ids."""
    from transformers import AutoTokenizer

    folder = _folder(tmp_path, bos_first)
    codec, reference = TextCodec.from_model(folder), AutoTokenizer.from_pretrained(str(folder))
    text = "Hello world, <|im_end|> and more"
    assert codec.encode_prompt(text) == reference(text).input_ids
    assert (codec.encode_prompt(text)[0] == 1) is bos_first
    chat = [{"role": "user", "content": "Hi"}]
    want = reference.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert codec.encode_chat(chat) == list(want) and codec.encode_chat(chat).count(1) == 1


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"tokenizer.ggml.bos_token_id": 40000}, "tokenizer.ggml.bos_token_id = 40000"),
        ({"tokenizer.ggml.model": "ugm"}, "'ugm'"),
        ({"tokenizer.ggml.model": "rwkv"}, "'rwkv'"),
    ],
)
def test_run_refuses_a_tokenizer_it_cannot_encode_in_one_line(
    tmp_path: Path, overrides: dict[str, Any], named: str
) -> None:
    """Before any weight is read (the file has none): one line naming the file, key and value."""
    from tests.support.cli import assert_clean_error, seamline

    path = vocab_copy("llama-spm", tmp_path / "bad.gguf", overrides)
    proc = seamline("run", "--model", str(path), "-p", "Hi")
    assert_clean_error(proc, str(path))
    assert named in proc.stderr and "tokenizer.ggml" in proc.stderr
