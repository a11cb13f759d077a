"""llama.cpp's split of a text at the tokens it matches whole (``gguf_partition.py``), on
made-up tokens: longest first, ASCII-only stripping, CONTROL tokens only when parsed."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, models, normalizers

from seamline.weights.gguf_partition import GGUFText, Partition, Whole

TITLE, END = Whole(">>TITLE<<", 1, special=False), Whole("<|endoftext|>", 2, special=True)


def test_overlapping_tokens_match_longest_first() -> None:
    """The longer token is cut out first wherever it starts; the shorter one no longer fits."""
    parts = Partition([TITLE, END]).split("a>>TITLE<<|endoftext|>b", parse_special=True)
    assert parts == ["a>>TITLE<", 2, "b"]
    assert Partition([TITLE, END]).split(">>TITLE<<x", parse_special=True) == [1, "x"]


def test_control_tokens_are_text_unless_special_tokens_are_parsed() -> None:
    user = Whole("<|user|>", 3, special=False)
    text = "<|endoftext|>hi<|user|>"
    assert Partition([END, user]).split(text, parse_special=False) == ["<|endoftext|>hi", 3]
    assert Partition([END, user]).split(text, parse_special=True) == [2, "hi", 3]


def test_stripping_takes_ascii_whitespace_only() -> None:
    """isspace in the C locale: space, \\t, \\n, \\v, \\f, \\r; never U+00A0 or U+3000."""
    right = Whole("<r>", 4, special=True, rstrip=True)
    left = Whole("<l>", 5, special=True, lstrip=True)
    partition = Partition([right, left])
    assert partition.split("<r> \t\n\v\f\rx", parse_special=True) == [4, "x"]
    assert partition.split("<r>\u3000x", parse_special=True) == [4, "\u3000x"]
    assert partition.split("<r>\u00a0 x", parse_special=True) == [4, "\u00a0 x"]
    assert partition.split("x \r\n<l>", parse_special=True) == ["x", 5]
    assert partition.split("x\u3000<l>", parse_special=True) == ["x\u3000", 5]
    assert partition.split("<r>  <r>", parse_special=True) == [4, 4]  # nothing left between


def test_every_occurrence_is_cut_and_no_stretch_is_empty() -> None:
    parts = Partition([END]).split("<|endoftext|><|endoftext|>a<|endoftext|>", parse_special=True)
    assert parts == [2, 2, "a", 2]
    assert Partition([END]).split("", parse_special=True) == []
    assert Partition([Whole("", 9, special=False), END]).split("ab", parse_special=True) == ["ab"]


def _spm_like() -> Tokenizer:
    """A word-level tokenizer whose normalizer puts "▁" before each stretch, as seamline's
    SentencePiece tokenizers do for add_space_prefix."""
    vocab = {"<unk>": 0, "<s>": 1, "▁hi": 2, "▁there": 3, "▁": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    return tok


def test_each_stretch_after_a_special_token_gets_the_space_prefix() -> None:
    """llama.cpp's SPM prefixes every raw stretch that starts the text or follows a token."""
    encoder = GGUFText(_spm_like())
    assert encoder.encode("hi<s>there") == [2, 1, 3]
    assert encoder.encode("<s>hi") == [1, 2]
    assert encoder.encode("hi<s>there", parse_special=False) == [0]  # "▁hi<s>there": one word
