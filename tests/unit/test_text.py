"""Text edge: chat template, streaming detokenisation and stop strings on the embedded tokenizer."""

from __future__ import annotations

import random

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
    cut = next(
        n for n in range(len(ids), 0, -1) if codec.decode_partial(ids[:n]).endswith("\ufffd")
    )
    decoder = StreamDecoder(codec, ())
    pieces = [decoder.push(token) for token in ids[:cut]] + [decoder.flush()]
    assert "".join(pieces) == "emoji " == codec.decode(ids[:cut]) and "\ufffd" not in "".join(
        pieces
    )


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


def test_streamed_pieces_join_to_the_whole_decode_for_any_ids(codec: TextCodec) -> None:
    """Random ids (split characters, lone bytes, special tokens among them): the pieces, with
    special tokens dropped or kept, always join to what decoding every id at once gives."""
    rng = random.Random(7)
    vocabulary = codec.tokenizer.get_vocab_size()
    for trial in range(300):
        ids = [
            rng.randrange(vocabulary) if rng.random() < 0.7 else rng.randrange(300)  # byte tokens
            for _ in range(rng.randint(1, 60))
        ]
        decoder = StreamDecoder(codec, ())
        decoder.special = trial % 2 == 1
        pieces = [decoder.push(token) for token in ids] + [decoder.flush()]
        assert "".join(pieces) == codec.decode(ids, decoder.special), ids


def test_a_token_decodes_a_window_not_the_whole_answer(codec: TextCodec) -> None:
    """A long answer costs each token a decode of a few ids (it decoded all of them: quadratic)."""
    decoded: list[int] = []

    class Counting(TextCodec):
        def decode_partial(self, ids: list[int], special: bool = False) -> str:
            decoded.append(len(ids))
            return super().decode_partial(ids, special)

    counting = Counting(codec.tokenizer, codec.chat_template, stop_ids=codec.stop_ids)
    decoder = StreamDecoder(counting, ())
    ids = codec.encode("word " * 2000)
    text = "".join(decoder.push(token) for token in ids) + decoder.flush()
    assert text == "word " * 2000
    assert max(decoded) <= 8, max(decoded)
