"""What every control message is built from: the base model, and the bounded fields members
send (``messages``)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

NODE_ID = re.compile(
    r"[A-Za-z0-9._-]{1,64}"
)  # what a node id may be: no log line or console event can be forged by one
MAX_REASON = 2048  # a failure's or error's text, in characters: a longer one is cut, never refused
_LINE_BREAKING = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u2028\u2029]"
)  # control characters, line separators


def node_id_refusal(node_id: str) -> str:
    """Why ``node_id`` cannot name a node ("" if it can); repr() keeps control characters out of logs."""
    if NODE_ID.fullmatch(node_id):
        return ""
    return f"node id {node_id[:80]!r} is not 1 to 64 of the characters A-Z a-z 0-9 . _ -"


def _clip(text: object) -> object:
    """A member's free text, cut to ``MAX_REASON`` and made one line: it is logged as it is."""
    return _LINE_BREAKING.sub(" ", text[:MAX_REASON]) if isinstance(text, str) else text


# Fields of what members send the coordinator are bounded, so the largest member message fits
# its control link's small cap (``joining.MEMBER_LIMITS``).
NodeName = Annotated[
    str, Field(pattern=rf"^{NODE_ID.pattern}$")
]  # a member's id, checked when it joined
Reason = Annotated[str, BeforeValidator(_clip), Field(max_length=MAX_REASON)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
