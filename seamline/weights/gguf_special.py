"""Which tokens llama.cpp matches whole in the text before tokenizing it, and how.

llama.cpp matches every CONTROL, UNKNOWN and USER_DEFINED token in the raw text (the first two
only when it parses special tokens: they become ``special`` added tokens here). It does not take
the token types as written: end-of-generation texts become CONTROL, some chat-format markers
USER_DEFINED, and a few models strip whitespace beside their special tokens
(``llama_vocab::impl::load``).

The added tokens record how each is matched; the matching itself is llama.cpp's, in
``gguf_partition.py`` (longest first where two overlap, ASCII whitespace stripped), not
``tokenizers``' (leftmost first, any Unicode whitespace): GGUF text is encoded through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer

from seamline.weights.gguf_file import GGUFFile

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp's token types (llama_token_type)

# texts llama.cpp makes CONTROL, whatever their type: end of generation (end of turn, message)
END_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)
# ... and fill-in-the-middle, where the file names no id for that kind (llama.cpp marks the first
# it meets of each kind; a vocabulary has one)
FIM_TEXTS = {
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_OLD_FIM_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}
USER_TEXTS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


@dataclass
class Special:
    text: str
    special: bool  # matched only when special tokens are parsed (CONTROL, UNKNOWN)
    lstrip: bool = False
    rstrip: bool = False


def _control_texts(f: GGUFFile) -> frozenset[str]:
    fim = [
        text
        for kind, texts in FIM_TEXTS.items()
        if f.get(f"tokenizer.ggml.{kind}_token_id") is None
        and f.get(f"tokenizer.ggml.{_OLD_FIM_KEYS.get(kind, kind)}_token_id") is None
        for text in texts
    ]
    return END_TEXTS | frozenset(fim)


def _kinds(f: GGUFFile, tokens: list[str], types: list[int]) -> dict[int, Special]:
    """id -> how llama.cpp matches it, after its fixes by token text."""
    found: dict[int, Special] = {}
    control = _control_texts(f)
    eog = {i for i, t in enumerate(tokens) if t in END_TEXTS}
    for key in ("eos", "eot", "eom"):
        value = f.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and 0 <= int(value) < len(tokens):  # llama.cpp drops others
            eog.add(int(value))
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if text in USER_TEXTS:
            found[i] = Special(text, special=False)
        elif kind in (UNKNOWN, CONTROL) or text in control:
            found[i] = Special(text, special=True)
        elif kind == USER_DEFINED:
            found[i] = Special(text, special=False)
    texts = {tokens[i] for i in eog}
    ends = [i for i in eog if tokens[i] == "<|end|>"]
    calls = bool(texts & {"<|call|>", "<|calls|>"})
    if ends and calls and texts & {"<|return|>", "<|flush|>"}:
        found[ends[0]] = Special("<|end|>", special=False)  # harmony: <|end|> is not an end
    if texts & {"<|tool_response>", "<|plamo:eos|>"}:
        for i in eog:
            if tokens[i] == "</s>":
                found.pop(i, None)  # a normal token there
    return found


def _strips(f: GGUFFile, tokens: list[str], found: dict[int, Special]) -> None:
    """llama.cpp's whitespace stripping beside special tokens, set by model name."""
    name = str(f.get("general.name") or "").lower()
    pre = str(f.get("tokenizer.ggml.pre") or "")
    arch = str(f.get("general.architecture") or "")
    ids = {t: i for i, t in enumerate(tokens)}
    if any(k in pre for k in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        k in arch for k in ("nomic-bert-moe", "jina-bert-v3")
    ):
        if "<mask>" in ids and ids["<mask>"] in found:
            found[ids["<mask>"]].lstrip = True
    elif "phi-3" in name or "phi3" in name:
        for special in found.values():
            special.rstrip = special.text not in ("<unk>", "<s>", "<|endoftext|>")
    elif "modern-bert" in name and "[MASK]" in ids and ids["[MASK]"] in found:
        found[ids["[MASK]"]].lstrip = True


def add_special_tokens(f: GGUFFile, tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """The tokens llama.cpp matches whole, as added tokens of ``tok`` (in id order)."""
    found = _kinds(f, tokens, types)
    _strips(f, tokens, found)
    added = [
        AddedToken(s.text, special=s.special, normalized=False, lstrip=s.lstrip, rstrip=s.rstrip)
        for _, s in sorted(found.items())
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
