"""A SentencePiece vocabulary in a GGUF file (``tokenizer.ggml.model == "llama"``: Llama 1/2,
Gemma) as a ``tokenizers.Tokenizer`` that encodes as llama.cpp's SPM tokenizer does.

llama.cpp writes spaces as "▁" (after a leading one where ``tokenizer.ggml.add_space_prefix``,
true unless said), splits the text into characters, and merges the adjacent pair whose joined
text is a token of the highest score, again and again; a character no token covers becomes its
UTF-8 bytes' ``<0xXX>`` tokens. That is BPE with a merge for every way a token splits into two
tokens, ranked by the joined token's score (highest first), and byte fallback.

One case differs: where two splits of the same token could both merge at once, llama.cpp merges
the leftmost, BPE the split ranked first (the shorter left part); as in "ab|a|ba" for "aba",
where the order changes the result. Real vocabularies give distinct scores, so nothing else ties.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers

from seamline.errors import CheckpointError
from seamline.weights.gguf_file import GGUFFile

SPACE = "\u2581"  # "▁", SentencePiece's space


def spm_tokenizer(f: GGUFFile, tokens: list[str]) -> Tokenizer:
    scores: list[float] = f.get("tokenizer.ggml.scores") or []
    if len(scores) != len(tokens):
        raise CheckpointError(
            f"GGUF file {f.path}: a SentencePiece vocabulary has {len(tokens)} tokens and "
            f"{len(scores)} scores"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    unknown = f.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unknown)] if unknown is not None else None
    pairs = merges(tokens, scores)
    tok = Tokenizer(models.BPE(vocab, pairs, byte_fallback=True, fuse_unk=True, unk_token=unk))  # type: ignore[arg-type]
    # llama.cpp puts the space before each stretch of text the added tokens leave (its first
    # included); the normalizer runs on each such stretch alone
    prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tail = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *tail]
    )
    return tok


def merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the joined token's score highest first (ties:
    its lower id, then the shorter left part). Every token takes part, whatever its type:
    llama.cpp merges any two symbols whose joined text is in the vocabulary."""
    ids = {token: i for i, token in enumerate(tokens)}
    found = []
    for token, i in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], i, cut, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]
