"""The tokenizer and chat template a GGUF file carries, as a ``tokenizers.Tokenizer`` that
encodes as llama.cpp does.

Supported ``tokenizer.ggml.model`` values: ``gpt2`` (byte-level BPE: tokens + merges, split first
by the regexes llama.cpp uses for ``tokenizer.ggml.pre``: ``gguf_pretok.py``), ``llama``
(SentencePiece: ``gguf_spm.py``) and ``gemma4`` (BPE on raw UTF-8 with "▁" for spaces). Tokens
llama.cpp matches whole become added tokens (``gguf_special.py``): special where it matches them
only when parsing special tokens (``<|im_start|>`` is one id), plain otherwise; a text is cut at
them as llama.cpp cuts it by ``gguf_partition.GGUFText``, not by the tokenizer. Anything else
(``ugm``, ``rwkv``, ``bert``, ``t5``, an unknown ``pre``) is refused by ``check_tokenizer``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from seamline.errors import CheckpointError
from seamline.weights.gguf_config import eos_ids
from seamline.weights.gguf_file import GGUFFile
from seamline.weights.gguf_pretok import NEWLINES, PRE_TOKENIZERS, PreTokenizer, split_steps
from seamline.weights.gguf_special import add_special_tokens
from seamline.weights.gguf_spm import SPACE, spm_tokenizer

NORMAL = 1  # llama.cpp's token type for a plain token
MODELS = ("gpt2", "llama", "gemma4")  # byte-level BPE, SentencePiece, Gemma 4's BPE


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # EOS, then end-of-turn / end-of-message when different
    add_bos_token: bool  # llama.cpp prepends BOS to a prompt
    chat_template: str | None


def tokenizer_from_gguf(path: str | os.PathLike[str]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` that encodes like llama.cpp's for this file's vocabulary."""
    f = GGUFFile.open(path)
    kind = check_tokenizer(f)
    tokens: list[str] = f.get("tokenizer.ggml.tokens") or []
    types: list[int] = f.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if not tokens or len(types) != len(tokens):
        raise CheckpointError(
            f"GGUF file {f.path}: tokenizer has {len(tokens)} tokens and {len(types)} token types"
        )
    if kind == "llama":
        tok = spm_tokenizer(f, tokens)
    elif kind == "gemma4":
        tok = _gemma4(f, tokens)
    else:
        tok = _byte_level(f, tokens, PRE_TOKENIZERS[f.get("tokenizer.ggml.pre")])
    add_special_tokens(f, tok, tokens, types)
    return tok


def check_tokenizer(f: GGUFFile) -> str:
    """The file's tokenizer model, or a one-line CheckpointError naming the key and value that
    seamline cannot encode (cheap: metadata only, so callers can refuse before loading weights)."""
    kind = f.get("tokenizer.ggml.model")
    if kind not in MODELS:
        raise CheckpointError(
            f"GGUF file {f.path}: tokenizer model {kind!r} (tokenizer.ggml.model) is unsupported; "
            "seamline reads 'gpt2' (byte-level BPE), 'llama' (SentencePiece) and 'gemma4'"
        )
    pre = f.get("tokenizer.ggml.pre")
    if kind == "gpt2" and pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"GGUF file {f.path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is unsupported; "
            f"seamline knows {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return str(kind)


def _merges(f: GGUFFile, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merge pairs, each split at its first space after the first character (as llama.cpp does:
    a token may begin with a space). A merge of or into text that is no token is refused: BPE
    here cannot hold one, and llama.cpp would go on merging it, then spell it out in bytes."""
    pairs = []
    for m in f.get("tokenizer.ggml.merges") or []:
        cut = m.find(" ", 1)
        left, right = m[:cut], m[cut + 1 :]
        if cut < 0 or left not in vocab or right not in vocab or left + right not in vocab:
            raise CheckpointError(
                f"GGUF file {f.path}: tokenizer.ggml.merges holds {m!r}, which is not a merge "
                "of two tokens into a token"
            )
        pairs.append((left, right))
    return pairs


def _byte_level(f: GGUFFile, tokens: list[str], pre: PreTokenizer) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, _merges(f, vocab), ignore_merges=pre.ignore_merges))  # type: ignore[arg-type]
    steps = split_steps(pre.splits)
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _gemma4(f: GGUFFile, tokens: list[str]) -> Tokenizer:
    """Gemma 4: spaces written as "▁", BPE merges over each line and each run of newlines on the
    raw UTF-8, bytes no token covers as ``<0xXX>`` tokens."""
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, _merges(f, vocab), byte_fallback=True))  # type: ignore[arg-type]
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Sequence(split_steps((NEWLINES,)))
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # llama.cpp takes a run of newlines that is a token whole, without merges; the merges must
    # reach the same token (they do in Gemma 4's vocabulary), since BPE here always merges
    run = "\n"
    while run in vocab:
        if [t.id for t in tok.model.tokenize(run)] != [vocab[run]]:
            raise CheckpointError(
                f"GGUF file {f.path}: tokenizer.ggml.merges do not make the token of {len(run)} "
                "newlines, which llama.cpp's Gemma 4 tokenizer takes whole"
            )
        run += "\n"
    return tok


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
