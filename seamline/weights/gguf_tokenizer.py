"""The tokenizer and chat template a GGUF file carries, as a ``tokenizers.Tokenizer``.

Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: tokens + merges), with the
pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre`` (``PRE_TOKENIZERS``). Tokens llama.cpp
marks CONTROL become special added tokens (``<|im_start|>`` is one id); USER_DEFINED ones
become plain added tokens, matched whole. SentencePiece (``llama``: Llama 1/2, Gemma)
vocabularies are read too (``gguf_spm.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from seamline.errors import CheckpointError
from seamline.weights.gguf_config import eos_ids
from seamline.weights.gguf_file import GGUFFile
from seamline.weights.gguf_spm import spm_tokenizer

# llama.cpp's token types (llama_token_type)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


@dataclass(frozen=True)
class PreTokenizer:
    splits: tuple[str, ...]  # regexes applied in order, each isolating its matches
    gpt2_regex: bool  # then byte-level with GPT-2's own split regex (else bytes only)
    ignore_merges: bool = False  # a whole-word vocabulary hit wins over merges (Llama 3)


_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the split llama.cpp's llama-vocab.cpp applies for it.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": PreTokenizer((), True),
    "smollm": PreTokenizer((r"\p{N}",), True),  # single digits, then GPT-2
    "llama3": PreTokenizer((_LLAMA3,), False, True),
    "llama-v3": PreTokenizer((_LLAMA3,), False, True),
    "llama-bpe": PreTokenizer((_LLAMA3,), False, True),
    "falcon3": PreTokenizer((_LLAMA3,), False, True),
    "smaug-bpe": PreTokenizer((_LLAMA3,), False),
    "dbrx": PreTokenizer((_LLAMA3,), False),
    "qwen2": PreTokenizer((_QWEN2,), False),
    "deepseek-r1-qwen": PreTokenizer((_QWEN2,), False),
}


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # EOS, then end-of-turn / end-of-message when different
    add_bos_token: bool  # llama.cpp prepends BOS to a prompt
    chat_template: str | None


def tokenizer_from_gguf(path: str | os.PathLike[str]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` that encodes like llama.cpp's for this file's vocabulary."""
    f = GGUFFile.open(path)
    kind = f.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(
            f"GGUF file {f.path}: tokenizer model {kind!r} is unsupported; "
            "seamline reads 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
        )
    pre = _pre_tokenizer_of(f) if kind == "gpt2" else None
    tokens: list[str] = f.get("tokenizer.ggml.tokens") or []
    types: list[int] = f.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if not tokens or len(types) != len(tokens):
        raise CheckpointError(
            f"GGUF file {f.path}: tokenizer has {len(tokens)} tokens and {len(types)} token types"
        )
    tok = _byte_level(f, tokens, pre) if pre is not None else spm_tokenizer(f, tokens, types)
    _add_tokens(tok, tokens, types)
    return tok


def _pre_tokenizer_of(f: GGUFFile) -> PreTokenizer:
    pre_name = f.get("tokenizer.ggml.pre")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise CheckpointError(
            f"GGUF file {f.path}: pre-tokenizer {pre_name!r} is unsupported; seamline knows "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return pre


def _byte_level(f: GGUFFile, tokens: list[str], pre: PreTokenizer) -> Tokenizer:
    merges: list[str] = f.get("tokenizer.ggml.merges") or []
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise CheckpointError(
            f"GGUF file {f.path}: a tokenizer merge is not two space-separated tokens"
        )
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges))  # type: ignore[arg-type]
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL tokens as special added tokens, USER_DEFINED ones as plain added tokens."""
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )


def _pre_tokenizer(pre: PreTokenizer) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.gpt2_regex))
    return pre_tokenizers.Sequence(steps)


def chat_template_from_gguf(path: str | os.PathLike[str]) -> str | None:
    """The Jinja chat template (``tokenizer.chat_template``), or None when the file has none."""
    value = GGUFFile.open(path).get("tokenizer.chat_template")
    return str(value) if value is not None else None


def tokenizer_info_from_gguf(path: str | os.PathLike[str]) -> GGUFTokenizerInfo:
    """BOS/EOS ids, whether to prepend BOS, and the chat template."""
    f = GGUFFile.open(path)
    bos = f.get("tokenizer.ggml.bos_token_id")
    template = f.get("tokenizer.chat_template")
    return GGUFTokenizerInfo(
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos_ids(f)),
        add_bos_token=bool(f.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=str(template) if template is not None else None,
    )
