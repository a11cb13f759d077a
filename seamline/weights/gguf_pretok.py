r"""The pre-tokenizers llama.cpp applies to byte-level BPE vocabularies, by ``tokenizer.ggml.pre``.

Each is llama.cpp's list of regexes (``llm_tokenizer_bpe`` in its ``src/llama-vocab.cpp``), applied
in order, each isolating its matches and the text between them; ``llama_regex`` makes the regex
engine of ``tokenizers`` match what llama.cpp's own does. The GPT-2, Llama 3, Qwen2 and Qwen3.5
regexes are hand-written loops there; the regexes below match exactly as those loops split (a lone
whitespace before a non-space is its own piece: the trailing ``|\s+`` the GPT-2 loop implements).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

from seamline.weights.gguf_unicode import llama_regex

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = _CONTRACTIONS + (
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = _CONTRACTIONS + (
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = _CONTRACTIONS + (
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}+",
)
DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")
DEEPSEEK3 = (  # DeepSeek-V3's; its kin share it
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
NEWLINES = "[^\n]+|[\n]+"  # Gemma 4: lines and runs of newlines


@dataclass(frozen=True)
class PreTokenizer:
    splits: tuple[str, ...]  # llama.cpp's regexes, applied in order
    ignore_merges: bool = False  # a whole-word vocabulary hit wins over merges (Llama 3)


def _table() -> dict[str, PreTokenizer]:
    groups: list[tuple[tuple[str, ...], PreTokenizer]] = [
        (("default",), PreTokenizer(DEFAULT)),
        (
            (
                "gpt-2",
                "phi-2",
                "jina-es",
                "jina-de",
                "gigachat",
                "jina-v2-es",
                "jina-v2-de",
                "a.x-4.0",
                "mellum",
                "modern-bert",
                "exaone4",
                "mpt",
                "olmo",
                "jais",
                "trillion",
                "granite-docling",
            ),
            PreTokenizer((GPT2,)),
        ),
        (
            (
                "starcoder",
                "refact",
                "command-r",
                "smollm",
                "codeshell",
                "exaone",
                "minerva-7b",
                "mellum2",
            ),
            PreTokenizer((r"\p{N}", GPT2)),
        ),
        (
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
                "glm4",
                "glm5",
            ),
            PreTokenizer((LLAMA3,), ignore_merges=True),
        ),
        (("dbrx", "smaug-bpe", "chatglm-bpe"), PreTokenizer((LLAMA3,))),
        (
            (
                "qwen2",
                "deepseek-r1-qwen",
                "kormo",
                "f2llmv2",
                "stablelm2",
                "hunyuan",
                "solar-open",
                "megrez",
                "grok-2",
            ),
            PreTokenizer((QWEN2,)),
        ),
        (("qwen35",), PreTokenizer((QWEN35,))),
        (("deepseek-llm",), PreTokenizer(DEEPSEEK_LLM)),
        (("deepseek-coder",), PreTokenizer(DEEPSEEK_CODER)),
        (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), PreTokenizer(DEEPSEEK3)),
        (("falcon",), PreTokenizer(FALCON)),
    ]
    return {name: pre for names, pre in groups for name in names}


# tokenizer.ggml.pre -> the regexes llama.cpp's llama-vocab.cpp applies for it
PRE_TOKENIZERS: dict[str, PreTokenizer] = _table()


def split_steps(splits: tuple[str, ...]) -> list[pre_tokenizers.PreTokenizer]:
    """Each regex as a ``Split`` isolating its matches (the text between them stays one piece)."""
    return [pre_tokenizers.Split(Regex(llama_regex(r)), behavior="isolated") for r in splits]
