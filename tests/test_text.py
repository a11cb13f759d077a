"""Text edge: chat template, streaming detokenisation and stop strings on the embedded tokenizer."""

from __future__ import annotations

import pytest

from seamline.app import default_model_path
from seamline.text import StreamDecoder, TextCodec


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_model(default_model_path())


def _stream(codec: TextCodec, text: str, stops: tuple[str, ...]) -> tuple[list[str], bool]:
    decoder = StreamDecoder(codec, stops)
    pieces = []
    for token in codec.encode(text):
        pieces.append(decoder.push(token))
        if decoder.stopped:
            break
    pieces.append(decoder.flush())
    return pieces, decoder.stopped


def test_stream_reassembles_text(codec: TextCodec) -> None:
    text = "Héllo, wörld! 12345 — emoji 🙂 and more"
    pieces, stopped = _stream(codec, text, ())
    assert "".join(pieces) == text and not stopped
    assert all("\ufffd" not in p for p in pieces)


def test_a_cut_inside_a_multibyte_character_drops_the_partial_character(codec: TextCodec) -> None:
    """Generation ending (max_tokens) after some of a character's bytes: the text ends before it."""
    ids = codec.encode("emoji 🦩")  # the flamingo is three tokens of its four bytes
    cut = next(n for n in range(len(ids), 0, -1) if codec.decode_partial(ids[:n]).endswith("\ufffd"))
    decoder = StreamDecoder(codec, ())
    pieces = [decoder.push(token) for token in ids[:cut]] + [decoder.flush()]
    assert "".join(pieces) == "emoji " == codec.decode(ids[:cut]) and "\ufffd" not in "".join(pieces)


def test_stop_string_cuts_output(codec: TextCodec) -> None:
    pieces, stopped = _stream(codec, "The answer is Paris, of course.", ("Paris",))
    assert stopped and "".join(pieces) == "The answer is "


def test_stop_string_across_tokens_is_never_shown(codec: TextCodec) -> None:
    pieces, stopped = _stream(codec, "alpha beta gamma delta", ("a gam",))
    assert stopped and "".join(pieces) == "alpha bet"


def test_chat_template_renders_generation_prompt(codec: TextCodec) -> None:
    text = codec.render_chat([{"role": "user", "content": "Hi there"}])
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert codec.stop_ids and codec.tokenizer.id_to_token(codec.stop_ids[0]) == "<|im_end|>"
