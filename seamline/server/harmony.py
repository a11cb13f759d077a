"""``reasoning_content`` for gpt-oss's harmony chat format: an answer is messages, each a header
(``<|start|>assistant<|channel|>NAME``, the first one's role given by the prompt) closed by
``<|message|>``, then its text up to ``<|end|>`` (another message follows), ``<|return|>`` or
``<|call|>``. Text on the ``analysis`` channel is reasoning; on any other channel (``final``,
``commentary``) it is content; headers and markers are neither. The markers are special tokens,
so the answer is decoded with them (``Generation.parse_special``); a marker split across pieces
is held back until it is whole. An answer that opens no header is content throughout.

A message to a tool (its header names a recipient, ``to=functions.NAME``) is a tool call: where
the answer is parsed for calls (``keep_calls``), it is passed on as content in the one shape the
tool-call parser reads (``<|start|>assistant to=functions.NAME<|message|>ARGS<|call|>``, as
``server/tool_formats.py`` has it), whatever order its header's parts came in.
"""

from __future__ import annotations

import re

from seamline.server.reasoning import partial_tag

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
CHANNEL = "<|channel|>"
REASONING_CHANNELS = ("analysis",)
RECIPIENT = re.compile(r"to=([^\s<]+)")
CALL_END = "<|call|>"


def uses_harmony(template: str | None) -> bool:
    return bool(template) and CHANNEL in template and MESSAGE in template  # type: ignore[operator]


class HarmonySplitter:
    """Feeds of answer text -> (reasoning, content), as ``ThinkSplitter``."""

    def __init__(self) -> None:
        self.pending = ""
        self.in_header = True  # before a message's <|message|>
        self.header = ""
        self.reasoning = False  # the current message is on a reasoning channel
        self.plain = False  # the answer opened no header: all of it is content
        self.keep_calls = False  # pass messages to tools on as calls (answers parsed for them)
        self.calling = False  # the current message is a call passed on

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        while self.pending:
            if self.plain:
                content, self.pending = content + self.pending, ""
            elif self.in_header:
                if not self._read_header():
                    break
            else:
                shown, closed = self._read_body()
                if self.calling:
                    content += shown + (CALL_END if closed else "")
                    self.calling = not closed
                elif self.reasoning:
                    reasoning += shown
                else:
                    content += shown
                if not closed:
                    break
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is left once the answer ends (a header never closed is dropped)."""
        rest, self.pending = self.pending, ""
        if self.in_header and not self.plain:
            plain = not self.header and not rest.lstrip().startswith(("<|", "to="))
            return "", rest if plain else ""
        if self.calling:  # the call's end marker is a stop token: not in the text
            self.calling = False
            return "", rest + CALL_END
        return (rest, "") if self.reasoning else ("", rest)

    def _read_header(self) -> bool:
        """Consume a header up to its <|message|>; False while it is incomplete."""
        at = self.pending.find(MESSAGE)
        if at < 0:
            head = self.pending.lstrip()
            if not self.header and not head.startswith(("<|", "to=")) and len(head) >= 3:
                self.plain = True  # text, not a header: the answer is plain content
                return True
            return False
        self.header, self.pending = self.pending[:at], self.pending[at + len(MESSAGE) :]
        channel = (
            self.header.split(CHANNEL, 1)[1].split("<|", 1)[0].split()
            if CHANNEL in self.header
            else []
        )
        self.reasoning = bool(channel) and channel[0] in REASONING_CHANNELS
        self.in_header = False
        recipient = RECIPIENT.search(self.header)
        if self.keep_calls and recipient is not None and recipient.group(1) != "assistant":
            self.calling, self.reasoning = True, False
            self.pending = f"<|start|>assistant to={recipient.group(1)}<|message|>" + self.pending
        return True

    def _read_body(self) -> tuple[str, bool]:
        """(the message text safe to show, whether its end marker came)."""
        ends = [(at, marker) for marker in ENDS if (at := self.pending.find(marker)) >= 0]
        if ends:
            at, marker = min(ends)
            shown, self.pending = self.pending[:at], self.pending[at + len(marker) :]
            self.in_header, self.header = True, ""
            return shown, True
        hold = max(partial_tag(self.pending, marker) for marker in ENDS)
        shown, self.pending = (
            self.pending[: len(self.pending) - hold],
            self.pending[len(self.pending) - hold :],
        )
        return shown, False
