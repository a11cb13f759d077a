"""GGUF vocabularies encode exactly as llama.cpp does: every vector llama.cpp ships beside its
``models/ggml-vocab-*.gguf`` files (``tests/test-tokenizer-0.cpp``: no BOS/EOS, control tokens
not parsed), llama.cpp's own Unicode classes, and one-line refusals of what seamline cannot
encode."""

from __future__ import annotations

import ast
import heapq
import random
import re
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from seamline.errors import CheckpointError
from seamline.weights import gguf_pretok as pretok
from seamline.weights.gguf_file import GGUFFile
from seamline.weights.gguf_partition import GGUFText
from seamline.weights.gguf_pretok import PRE_TOKENIZERS, split_steps
from seamline.weights.gguf_special import END_TEXTS
from seamline.weights.gguf_tokenizer import check_tokenizer, tokenizer_from_gguf
from seamline.weights.gguf_unicode import RANGES, WHITESPACE
from seamline_bench.conformance_vocab import VOCABS, vocab_failures, vocab_path
from tests.support.llama_cpp import gemma3_270m, llama_cpp_source


@cache
def _source() -> Path:
    return llama_cpp_source()


@cache
def _tokenizer(path: Path) -> Tokenizer:
    """The file's tokenizer as a package serves it: through its tokenizer.json."""
    return Tokenizer.from_str(tokenizer_from_gguf(path).to_str())


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_vectors(name: str) -> None:
    count, wrong = vocab_failures(name, _tokenizer(vocab_path(name)))
    report = "\n".join(wrong[:20])
    assert not wrong, f"{name}: {len(wrong)} of {count} vectors differ\n{report}"


def _llama_categories() -> tuple[dict[str, list[tuple[int, int]]], list[int]]:
    """llama.cpp's codepoint ranges per category, and its whitespace, from unicode-data.cpp."""
    text = (_source() / "src" / "unicode-data.cpp").read_text(encoding="utf-8")
    body = text.split("unicode_ranges_flags = {")[1].split("};")[0]
    flags = [(int(a, 16), int(b, 16)) for a, b in re.findall(r"\{0x(\w+), 0x(\w+)\}", body)]
    names = {0x02: "N", 0x04: "L", 0x10: "M", 0x20: "P", 0x40: "S"}
    ranges: dict[str, list[tuple[int, int]]] = {name: [] for name in names.values()}
    for (first, flag), (end, _) in pairwise(flags):
        if (name := names.get(flag & 0xFF)) is None:
            continue
        if ranges[name] and ranges[name][-1][1] == first - 1:
            ranges[name][-1] = (ranges[name][-1][0], end - 1)
        else:
            ranges[name].append((first, end - 1))
    ws = text.split("unicode_set_whitespace = {")[1].split("};")[0]
    return ranges, sorted(int(c, 16) for c in re.findall(r"0x(\w+)", ws))


def test_unicode_classes_are_llama_cpps() -> None:
    ranges, whitespace = _llama_categories()
    for name, expected in ranges.items():
        ours = []
        for item in RANGES[name].split():
            first, _, last = item.partition("-")
            ours.append((int(first, 16), int(last or first, 16)))
        assert ours == expected, f"\\p{{{name}}} differs from llama.cpp's unicode-data.cpp"
    assert [int(c, 16) for c in WHITESPACE.split()] == whitespace


# -- llama.cpp's unicode_regex_split, modelled independently: its hand-written loops for the
# GPT-2 / Llama 3 / Qwen2 / Qwen3.5 regexes, std::regex on the category-collapsed text for a
# regex with \p{..}, and on the codepoints with non-ASCII whitespace as U+000B for one without.
# Python's re with re.ASCII stands in for ECMAScript std::regex in the C locale ($ -> \Z).

_COLLAPSE = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_ASCII_CLASS = {
    "N": "0-9",
    "L": "A-Za-z",
    "P": r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": "",
    "S": r"\$\+<->\^`\|~",
}
_LLAMA3_KEY = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@cache
def _flags() -> tuple[dict[int, str], frozenset[int]]:
    """Codepoint -> category letter (only N L M P S), and the whitespace set."""
    ranges, ws = _llama_categories()
    return {c: n for n, rs in ranges.items() for a, b in rs for c in range(a, b + 1)}, frozenset(ws)


_LOOPS = {  # the regexes llama.cpp's unicode.cpp implements by hand
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)": "gpt2",
    _LLAMA3_KEY: "llama3",
    _LLAMA3_KEY.replace(r"\p{N}{1,3}", r"\p{N}"): "qwen2",
    _LLAMA3_KEY.replace(r"\p{N}{1,3}", r"\p{N}")
    .replace(r"?\p{L}+", r"?[\p{L}\p{M}]+")
    .replace(r"[^\s\p{L}\p{N}]", r"[^\s\p{L}\p{M}\p{N}]"): "qwen35",
}


def _custom_split(text: str, kind: str) -> list[int]:
    """llama.cpp's loop for one of the four regexes it implements by hand: piece lengths."""
    cat, ws = _flags()
    n, out, pos = len(text), [], 0

    def k(i: int) -> str:  # "W"hitespace, a category, "?" for any other, "" past the end
        return "" if i >= n else "W" if ord(text[i]) in ws else cat.get(ord(text[i]), "?")

    def word(i: int) -> bool:  # \p{L} (Qwen3.5: [\p{L}\p{M}])
        return k(i) == "L" or (kind == "qwen35" and k(i) == "M")

    def other(i: int) -> bool:  # [^\s\p{L}\p{N}] (Qwen3.5: [^\s\p{L}\p{M}\p{N}])
        return k(i) not in ("", "W", "L", "N") and not word(i)

    def low(i: int) -> str:  # the loops but GPT-2's compare lowercase (ASCII only reaches "s")
        if i >= n or kind == "gpt2" or not text[i].isascii():
            return text[i] if i < n else ""
        return text[i].lower()

    while pos < n:
        start, ch = pos, text[pos]
        if ch == "'" and pos + 1 < n and low(pos + 1) in ("s", "t", "m", "d"):
            pos += 2
        elif ch == "'" and pos + 2 < n and low(pos + 1) + low(pos + 2) in ("re", "ve", "ll"):
            pos += 3
        elif kind == "gpt2" and k(pos + (ch == " ")) in ("L", "N"):
            pos += ch == " "
            run = k(pos)
            while k(pos) == run:
                pos += 1
        elif kind != "gpt2" and ch not in "\r\n" and k(pos) != "N" and (word(pos) or word(pos + 1)):
            pos += 1
            while word(pos):
                pos += 1
        elif kind != "gpt2" and k(pos) == "N":
            pos += 1
            while kind == "llama3" and k(pos) == "N" and pos - start < 3:
                pos += 1
        elif other(pos + (ch == " ")) or (kind != "gpt2" and ch == " " and pos + 1 == n):
            pos += ch == " "
            while other(pos):
                pos += 1
            while kind != "gpt2" and pos < n and text[pos] in "\r\n":
                pos += 1
        else:
            run = 0
            while k(pos + run) == "W":
                run += 1
            last = max((i + 1 for i in range(pos, pos + run) if text[i] in "\r\n"), default=0)
            if kind != "gpt2" and last:
                pos = last
            elif run > 1 and pos + run < n:
                pos += run - 1
            else:
                pos += max(run, 1)
        out.append(pos - start)
    return out


def _collapsed(regex: str) -> str:
    def body(m: re.Match[str]) -> str:
        name = m.group(1)[0]
        return _COLLAPSE[name] + _ASCII_CLASS[name]

    out, inside = [], False
    for m in re.finditer(r"\\p\{(\w+)\}|\\.|\[|\]|.", regex, re.DOTALL):
        tok = m.group(0)
        if m.group(1):
            out.append(body(m) if inside else f"[{body(m)}]")
            continue
        inside = True if tok == "[" else False if tok == "]" else inside
        out.append(r"\Z" if tok == "$" and not inside else tok)
    return "".join(out)


def llama_split(text: str, regexes: tuple[str, ...]) -> list[str]:
    cat, ws = _flags()

    def collapse(ch: str) -> str:
        if ord(ch) < 128:
            return ch
        return "\x0b" if ord(ch) in ws else _COLLAPSE.get(cat.get(ord(ch), ""), "\xd0")

    collapsed = "".join(map(collapse, text))
    wide = "".join("\x0b" if ord(ch) > 127 and ord(ch) in ws else ch for ch in text)
    pieces = [(0, len(text))]
    for regex in regexes:
        kind, split = _LOOPS.get(regex), []
        for start, end in pieces:
            if kind:
                lengths = _custom_split(text[start:end], kind)
            else:
                subject = collapsed if "\\p{" in regex else wide
                pattern = re.compile(_collapsed(regex), re.ASCII)
                lengths, at = [], 0
                for m in pattern.finditer(subject[start:end]):
                    lengths += ([m.start() - at] if m.start() > at else []) + [m.end() - m.start()]
                    at = m.end()
                lengths += [end - start - at] if at < end - start else []
            for length in lengths:
                split.append((start, start + length))
                start += length
        pieces = split
    return [text[a:b] for a, b in pieces]


@cache
def _llama_pre_types() -> dict[str, tuple[tuple[str, ...], bool]]:
    """tokenizer.ggml.pre -> (llama.cpp's regexes, ignore_merges), read from llama-vocab.cpp."""
    src = (_source() / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    strings = r'"((?:[^"\\\n]|\\.)*)"'
    section = src[src.index("struct llm_tokenizer_bpe : llm_tokenizer") :]
    section = section[: section.index("std::vector<std::string> regex_exprs;")]
    regexes: dict[str, tuple[str, ...]] = {}
    for chunk in section.split("break;"):
        code = "\n".join(line for line in chunk.splitlines() if not line.strip().startswith("//"))
        if "regex_exprs = {" not in code:
            continue
        body = code[code.index("regex_exprs = {") : code.index("};")]
        found = tuple(ast.literal_eval(f'"{m}"') for m in re.findall(strings, body))
        labels = re.findall(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):", code)
        for label in labels + (["DEFAULT"] if "default:" in code else []):
            regexes[label] = found
    load = src[src.index("if (tokenizer_pre.empty())") : src.index("unknown pre-tokenizer type")]
    table = {}
    for chunk in load.split("} else if ("):
        kind = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", chunk)
        for name in re.findall(r'tokenizer_pre == "([^"]+)"', chunk):
            assert kind, name
            table[name] = (regexes[kind.group(1)], "ignore_merges = true;" in chunk)
    return table


def _ours(regexes: tuple[str, ...]) -> tuple[str, ...]:
    """Ours, written as llama.cpp's: the GPT-2 regex there has no trailing |\\s+ (its loop has)."""
    return tuple(r.removesuffix(r"|\s+") if r == pretok.GPT2 else r for r in regexes)


def test_pre_tokenizers_are_llama_cpps() -> None:
    llama = _llama_pre_types()
    for name, pre in PRE_TOKENIZERS.items():
        assert name in llama, f"{name}: no such tokenizer.ggml.pre in llama.cpp"
        assert _ours(pre.splits) == llama[name][0], f"{name}: regexes differ from llama.cpp's"
        assert pre.ignore_merges == llama[name][1], f"{name}: ignore_merges differs"


# characters where the regex engine's or Python's Unicode tables could disagree with llama.cpp's:
# whitespace kinds, marks, numbers of every kind, CJK, punctuation llama.cpp lists by hand,
# unassigned (U+0378), private use, format (U+200B), and characters Unicode 16 assigned (llama.cpp's
# tables have them; the regex engine's own did not: a letter, a digit, a mark, punctuation, a symbol)
_POOL = (
    "aZ09'sStTmMdDrReEvVlL ſ\t\n\r\x0b\x0c\x1c\x85\xa0\u1680\u2000\u2028\u3000\u202f"
    '!?.,;:-_$+<=>^`|~@#%&*()[]{}/\\"é\u0301\u0903\u20dd²½Ⅻ٣१一龥、。！‘，가ㄱࠀ'
    "\u0378\ue000\u200b😀€µÀǅʰ\U0001e030\U00011f00\u0e3f\u0e31\u1c89\U00010d40\u0897\u1b4e\u2427"
)


def _random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(_POOL, k=rng.randint(1, 14))) for _ in range(count)]


@pytest.mark.parametrize(
    "name",
    sorted(
        {*PRE_TOKENIZERS}
        & {
            "gpt-2",
            "starcoder",
            "llama-bpe",
            "dbrx",
            "qwen2",
            "qwen35",
            "deepseek-llm",
            "deepseek-coder",
            "deepseek-v3",
            "falcon",
            "default",
        }
    ),
)
def test_pre_tokenizer_splits_as_llama_cpp(name: str) -> None:
    """Random text over the characters where the regexes' classes matter, split by ours and by
    the model of llama.cpp's splitting above, piece for piece."""
    llama_regexes = _llama_pre_types()[name][0]
    ours = pre_tokenizers.Sequence(split_steps(PRE_TOKENIZERS[name].splits))
    wrong = []
    for text in _random_texts(1500, seed=len(name)):
        want = llama_split(text, llama_regexes)
        got = [piece for piece, _ in ours.pre_tokenize_str(text)]
        if got != want:
            wrong.append(f"  {text!r}: llama.cpp {want}, seamline {got}")
    assert not wrong, f"{name}: {len(wrong)} texts split differently\n" + "\n".join(wrong[:10])


# -- llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm_session), modelled independently:
# the text cut at the tokens it matches whole (longest first), "▁" for spaces after a leading one
# per stretch, then the highest-scoring adjacent pair whose text is a token merged, ties leftmost.


def _spm_piece(text: str, ids: dict[str, int], scores: list[float], out: list[int]) -> None:
    n = len(text)
    size, prev, nxt = [1] * n, list(range(-1, n - 1)), [*range(1, n), -1]
    queue: list[tuple[float, int, int, int]] = []
    split: dict[str, tuple[int, int]] = {}

    def pair(left: int, right: int) -> None:
        joined = text[left : right + size[right]] if left >= 0 and right >= 0 else ""
        if (t := ids.get(joined)) is not None:
            heapq.heappush(queue, (-scores[t], left, right, len(joined)))
            split[joined] = (left, right)

    for i in range(1, n):
        pair(i - 1, i)
    while queue:
        _, left, right, length = heapq.heappop(queue)
        if not size[left] or not size[right] or size[left] + size[right] != length:
            continue
        size[left], size[right] = length, 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        pair(prev[left], left)
        pair(left, nxt[left])

    def emit(i: int) -> None:
        piece = text[i : i + size[i]]
        if piece in ids:
            out.append(ids[piece])
        elif piece in split:
            emit(split[piece][0])
            emit(split[piece][1])
        else:
            out.extend(ids.get(f"<0x{b:02X}>", ids.get(chr(b), -1)) for b in piece.encode())

    i = 0 if n else -1
    while i >= 0:
        emit(i)
        i = nxt[i]


@dataclass(frozen=True)
class _Spm:
    tokens: list[str]
    ids: dict[str, int]
    scores: list[float]
    prefix: str  # " " where llama.cpp adds a space prefix
    user: list[int]  # matched whole always: USER_DEFINED (but end texts, made CONTROL)
    special: list[int]  # ... and with special parsing: CONTROL, UNKNOWN
    strip: bool  # Phi-3: llama.cpp strips ASCII whitespace right of its special tokens

    @classmethod
    def read(cls, f: GGUFFile) -> _Spm:
        tokens, types = f.get("tokenizer.ggml.tokens"), f.get("tokenizer.ggml.token_type")
        user = [i for i, k in enumerate(types) if k == 4 and tokens[i] not in END_TEXTS]
        longest = sorted(range(len(tokens)), key=lambda i: -len(tokens[i]))
        name = str(f.get("general.name")).lower()
        return cls(
            tokens,
            {t: i for i, t in enumerate(tokens)},
            f.get("tokenizer.ggml.scores"),
            " " if f.get("tokenizer.ggml.add_space_prefix", True) else "",
            [i for i in longest if i in set(user)],
            [i for i in longest if types[i] in (2, 3, 4)],
            "phi3" in name or "phi-3" in name,
        )


def llama_spm(text: str, v: _Spm, parse_special: bool) -> list[int]:
    pieces: list[str | int] = [text]
    for i in v.special if parse_special else v.user:
        rstrip = v.strip and v.tokens[i] not in ("<unk>", "<s>", "<|endoftext|>")
        cut: list[str | int] = []
        for piece in pieces:
            while isinstance(piece, str) and v.tokens[i] in piece:
                left, _, piece = piece.partition(v.tokens[i])
                cut += [left, i] if left else [i]
                piece = piece.lstrip(" \t\n\v\f\r") if rstrip else piece
            cut += [piece] if piece != "" else []
        pieces = cut
    out: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            out.append(piece)
        else:
            _spm_piece((v.prefix + piece).replace(" ", "\u2581"), v.ids, v.scores, out)
    return out


def _spm_texts(v: _Spm, count: int) -> list[str]:
    """Vocabulary pieces (spaces for "▁"), whole-matched and special texts, odd characters."""
    rng = random.Random(7)
    odd = [v.tokens[i] for i in v.special] + ["<0x0A>", "<s>", *"  \n\t\u3000é😀一'"]
    pick = [[t.replace("\u2581", " ") for t in v.tokens], odd]
    return [
        "".join(rng.choice(pick[rng.random() > 0.75]) for _ in range(rng.randint(1, 6)))
        for _ in range(count)
    ]


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "gemma-3-270m"])
def test_sentencepiece_encodes_as_llama_cpp(name: str) -> None:
    """Random text, with and without special tokens parsed, against the model above; Gemma 3's
    file sets tokenizer.ggml.add_space_prefix false (llama.cpp's default for SPM is true)."""
    gemma = name.startswith("gemma")
    path = gemma3_270m() if gemma else _source() / "models" / f"ggml-vocab-{name}.gguf"
    f = GGUFFile.open(path)
    assert f.get("tokenizer.ggml.add_space_prefix", True) is not gemma
    vocab, encoder = _Spm.read(f), GGUFText(_tokenizer(path))
    wrong = []
    for parse_special in (False, True):
        for text in _spm_texts(vocab, 400):
            want = llama_spm(text, vocab, parse_special)
            got = encoder.encode(text, parse_special)
            if got != want:
                wrong.append(f"  {text!r} (special: {parse_special}): {want} != {got}")
    assert not wrong, f"{name}: {len(wrong)} texts differ\n" + "\n".join(wrong[:10])


def test_add_space_prefix_is_the_files() -> None:
    """The first stretch of text gets llama.cpp's leading "▁" only where the file asks for it."""
    llama = _tokenizer(_source() / "models" / "ggml-vocab-llama-spm.gguf")
    gemma = _tokenizer(gemma3_270m())
    llama.encode_special_tokens = gemma.encode_special_tokens = True
    assert llama.encode("Hello world", add_special_tokens=False).tokens == ["▁Hello", "▁world"]
    assert gemma.encode("Hello world", add_special_tokens=False).tokens == ["Hello", "▁world"]
    assert gemma.encode("a\nb", add_special_tokens=False).tokens == ["a", "\n", "b"]


def test_phi3_strips_only_ascii_whitespace_after_special_tokens() -> None:
    """Phi-3's files make llama.cpp strip the whitespace right of a special token, isspace()
    only: U+3000 stays (an added token's rstrip in tokenizers would take it, and U+00A0)."""
    path = _source() / "models" / "ggml-vocab-phi-3.gguf"
    text = "<|assistant|>\u3000x"
    want = llama_spm(text, _Spm.read(GGUFFile.open(path)), parse_special=True)
    assert GGUFText(_tokenizer(path)).encode(text) == want


def test_overlapping_special_tokens_match_longest_first() -> None:
    """llama.cpp cuts the text at its longest special tokens first, so in
    ">>TITLE<<|endoftext|>" Falcon's <|endoftext|> wins over the >>TITLE<< it overlaps (added
    tokens in tokenizers would match the leftmost)."""
    tok = _tokenizer(_source() / "models" / "ggml-vocab-falcon.gguf")
    ids = GGUFText(tok).encode(">>TITLE<<|endoftext|>")
    assert ids[-1] == tok.token_to_id("<|endoftext|>") and tok.token_to_id(">>TITLE<<") not in ids


def _write(path: Path, meta: dict[str, str]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("model", "pre", "key", "value"),
    [
        *[(m, None, "tokenizer.ggml.model", m) for m in ("ugm", "rwkv", "bert", "t5")],
        ("gpt2", "mystery", "tokenizer.ggml.pre", "mystery"),
        ("gpt2", None, "tokenizer.ggml.pre", None),
    ],
)
def test_unsupported_tokenizers_are_refused(
    tmp_path: Path, model: str, pre: str | None, key: str, value: str | None
) -> None:
    """Refused from the metadata alone (no tokens, merges or weights read), in one line naming
    the file, the key and its value."""
    meta = {"tokenizer.ggml.model": model, **({"tokenizer.ggml.pre": pre} if pre else {})}
    path = _write(tmp_path / f"{model}-{pre}.gguf", meta)
    for refuse in (lambda: check_tokenizer(GGUFFile.open(path)), lambda: tokenizer_from_gguf(path)):
        with pytest.raises(CheckpointError) as caught:
            refuse()
        message = str(caught.value)
        assert "\n" not in message, message
        assert str(path) in message and key in message and repr(value) in message, message


def test_supported_tokenizer_models_pass_the_check(tmp_path: Path) -> None:
    for model, pre in (("llama", None), ("gemma4", None), ("gpt2", "qwen35"), ("gpt2", "falcon")):
        meta = {"tokenizer.ggml.model": model, **({"tokenizer.ggml.pre": pre} if pre else {})}
        assert check_tokenizer(GGUFFile.open(_write(tmp_path / f"{model}.gguf", meta))) == model
