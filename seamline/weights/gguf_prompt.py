"""What a GGUF file's prompts begin and end with, decided as llama.cpp decides it
(``llama_vocab::impl::load`` in ``src/llama-vocab.cpp``).

BOS is put first where ``tokenizer.ggml.add_bos_token`` says so; where the key is absent, by
llama.cpp's default for the vocabulary: SentencePiece (``llama``) adds it, byte-level BPE
(``gpt2``) does not, except for the pre-tokenizers llama.cpp marks as adding it (Llama 3's and
its kin, Tekken, Chameleon); Gemma 4's vocabulary always adds it. EOS likewise from
``tokenizer.ggml.add_eos_token`` (default: not added). GLM-4's pre-tokenizers have no BOS.
"""

from __future__ import annotations

from dataclasses import dataclass

from seamline.errors import CheckpointError
from seamline.weights.gguf_file import GGUFFile
from seamline.weights.gguf_special import END_TEXTS  # llama.cpp's end-of-generation texts

BOS_KEY, EOS_KEY = "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"
ADD_BOS_KEY, ADD_EOS_KEY = "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"
# pre-tokenizers after which llama.cpp adds BOS by default (a byte-level BPE vocabulary)
BOS_BY_DEFAULT = frozenset(
    (
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
        "tekken",
        "chameleon",
    )
)
NO_BOS = frozenset(("chatglm-bpe", "glm4", "glm5"))  # llama.cpp sets their BOS to none
# (BOS, EOS) where the file names none: llama.cpp's defaults per tokenizer model
DEFAULT_IDS: dict[str, tuple[int, int]] = {"llama": (1, 2), "gpt2": (11, 11)}


@dataclass(frozen=True)
class GGUFPromptEnds:
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool

    @property
    def prefix(self) -> tuple[int, ...]:
        return (self.bos_id,) if self.add_bos and self.bos_id is not None else ()

    @property
    def suffix(self) -> tuple[int, ...]:
        return (self.eos_id,) if self.add_eos and self.eos_id is not None else ()


def prompt_ends_from_gguf(f: GGUFFile) -> GGUFPromptEnds:
    """BOS and EOS as llama.cpp puts them around a prompt; CheckpointError (naming the file,
    the key and its value) for an id past the vocabulary, or one the file asks to add but
    does not name."""
    model, pre = f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.pre")
    count = len(f.get("tokenizer.ggml.tokens") or ())
    default_bos, default_eos = DEFAULT_IDS.get(str(model), (None, None))
    bos = None if pre in NO_BOS else _token_id(f, BOS_KEY, count, default_bos)
    eos = _token_id(f, EOS_KEY, count, default_eos)
    add_bos = _flag(f, ADD_BOS_KEY, default=_bos_by_default(model, pre))
    add_bos = add_bos or model == "gemma4"
    add_eos = _flag(f, ADD_EOS_KEY, default=False)
    if add_bos and bos is None and pre not in NO_BOS:
        raise CheckpointError(f"GGUF file {f.path}: {ADD_BOS_KEY} is true but {BOS_KEY} is missing")
    if add_eos and eos is None:
        raise CheckpointError(f"GGUF file {f.path}: {ADD_EOS_KEY} is true but {EOS_KEY} is missing")
    return GGUFPromptEnds(bos, eos, add_bos, add_eos)


def _bos_by_default(model: object, pre: object) -> bool:
    if model == "llama":  # SentencePiece
        return True
    return model == "gpt2" and pre in BOS_BY_DEFAULT


def _flag(f: GGUFFile, key: str, default: bool) -> bool:
    value = f.get(key)
    return default if value is None else bool(value)


def _token_id(f: GGUFFile, key: str, count: int, default: int | None) -> int | None:
    value = f.get(key)
    if value is None:
        return default if default is not None and default < count else None
    if not 0 <= int(value) < count:
        raise CheckpointError(
            f"GGUF file {f.path}: {key} = {value} is past the vocabulary's {count} tokens"
        )
    return int(value)


END_KEYS = tuple(
    f"tokenizer.ggml.{k}_token_id" for k in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
)


def end_of_generation_ids(f: GGUFFile) -> tuple[int, ...]:
    """The ids a generation ends at, as llama.cpp's ``special_eog_ids``: EOS first, then the
    file's other end ids, then the tokens llama.cpp names by their text (``END_TEXTS``); harmony's ``<|end|>`` is not
    one where ``<|return|>`` and ``<|call|>`` are (it ends a message, not the answer)."""
    tokens: list[str] = f.get("tokenizer.ggml.tokens") or []
    ids = [int(v) for k in END_KEYS if (v := f.get(k)) is not None and 0 <= int(v) < len(tokens)]
    ids += [i for i, text in enumerate(tokens) if text in END_TEXTS]
    ends = list(dict.fromkeys(ids))
    texts = {tokens[i] for i in ends}
    if "<|end|>" in texts and "<|return|>" in texts and texts & {"<|call|>", "<|calls|>"}:
        ends = [i for i in ends if tokens[i] != "<|end|>"]
    return tuple(ends)
