"""``reasoning_content``: a chat answer's think block, apart from its content.

For chat templates that use think blocks (``<think>`` … ``</think>``, as DeepSeek-R1/V3.1+ and
Qwen3 do), the text inside the block is the reasoning and the text after it the content. A
template that opens the block itself (its generation prompt ends in ``<think>``) starts the
answer inside it; otherwise the answer may open one at its very start. A tag split across
tokens is held back until it is whole, so no piece of a tag is ever shown.
"""

from __future__ import annotations

from typing import Protocol

OPEN, CLOSE = "<think>", "</think>"


class Splitter(Protocol):
    """Feeds of an answer's text -> (reasoning, content) safe to show; ``flush`` at its end."""

    def feed(self, text: str) -> tuple[str, str]: ...

    def flush(self) -> tuple[str, str]: ...


def uses_think_blocks(template: str | None) -> bool:
    return bool(template) and CLOSE in template  # type: ignore[operator]


class ThinkSplitter:
    def __init__(self, prompt_text: str) -> None:
        self.thinking = prompt_text.rstrip().endswith(OPEN)  # the template opened the block
        self.may_open = not self.thinking  # the answer may open one, at its start only
        self.pending = ""
        self.just_closed = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) safe to show after ``text``."""
        self.pending += text
        reasoning = content = ""
        while True:
            tag = CLOSE if self.thinking else OPEN
            at = self.pending.find(tag)
            if self.may_open and not self.thinking and not self._may_still_open():
                self.may_open = False  # the answer began without a think block
            if at >= 0 and (self.thinking or (self.may_open and not self.pending[:at].strip())):
                if self.thinking:
                    reasoning += self.pending[:at]
                self.pending = self.pending[at + len(tag) :]
                self.thinking, self.may_open = not self.thinking, False
                self.just_closed = not self.thinking  # the newlines after the block are not content
                continue
            hold = partial_tag(self.pending, tag) if (self.thinking or self.may_open) else 0
            shown, self.pending = (
                self.pending[: len(self.pending) - hold],
                self.pending[len(self.pending) - hold :],
            )
            if self.thinking:
                reasoning += shown
            elif not self.may_open:
                if self.just_closed:
                    shown = shown.lstrip("\n")
                    self.just_closed = not shown
                content += shown
            else:
                self.pending = shown + self.pending  # whitespace before a possible <think>: wait
            return reasoning, content

    def _may_still_open(self) -> bool:
        """Whether what came so far (after whitespace) may yet be ``<think>``."""
        head = self.pending.lstrip()
        return OPEN.startswith(head[: len(OPEN)])

    def flush(self) -> tuple[str, str]:
        """What is left once the answer ends (an unclosed block is reasoning)."""
        rest, self.pending = self.pending, ""
        return (
            (rest, "") if self.thinking else ("", rest.lstrip("\n") if self.just_closed else rest)
        )


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
