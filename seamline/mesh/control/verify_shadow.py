"""A followed request as the coordinator checks it (``verify``): the one stage it checks, that
stage's cache in the coordinator's copy, and the input rows the stage showed for it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from seamline.mesh.control.link_blame import Statement
from seamline.net.byte_parts import gather
from seamline.net.frames import TokenRow
from seamline.net.messages import KeptRows, Open
from seamline.runtime.kept_inputs import KeptInputs


@dataclass
class Shadow:
    """A checked request as the coordinator computes it."""

    opening: Open
    tokens: list[int]  # prompt, then the tokens drawn so far (the mesh's)
    chosen: int  # the stage checked: drawn once the request is followed, told to no stage
    cache: object  # the chosen stage's cache in the reference
    next_position: int = 0  # the reference has run the positions before this
    checked_to: int = 0  # the rows before this position checked out
    rows: dict[tuple[int, int], dict[int, torch.Tensor]] = field(
        default_factory=dict
    )  # (position, count) -> stage -> [2, W]
    seen: dict[tuple[int, int], float] = field(
        default_factory=dict
    )  # (position, count) -> when a stage first reported it
    logits: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # position drawn for -> the reference's logits (the chosen stage is the last)
    held: list[TokenRow] = field(default_factory=list)
    statements: dict[tuple[int, int], dict[int, Statement]] = field(
        default_factory=dict
    )  # (position, count) -> receiving stage -> the statement of the frame it came in
    shown: KeptInputs = field(default_factory=KeptInputs)  # the rows the chosen stage showed
    ended: bool = False  # its last token came: the chosen stage may be asked for its rows
    asked: tuple[int, int] | None = None  # positions asked of the chosen stage, not yet shown
    arriving: bytearray = field(default_factory=bytearray)  # the asked rows' bytes so far
    waiting_since: float | None = None  # since when rows asked of it are missing

    @property
    def request(self) -> int:
        return self.opening.request

    def shown_rows(self, start: int, end: int) -> torch.Tensor | None:
        return self.shown.rows(self.request, start, end)

    def run_from(self, position: int) -> int:
        """Where the reference's run of a row at ``position`` begins: the sequence started over
        (preempted) when the row goes back, and a fork's prefix is run before its first row."""
        return 0 if position < self.next_position else self.next_position


def shown_part(
    shadow: Shadow, part: KeptRows, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """Take a part of the rows asked of ``shadow``'s chosen stage: the rows, [count, *shape] in
    ``dtype``, once all their bytes came (None before); ValueError when the parts do not
    make the rows asked, in order."""
    assert shadow.asked is not None, "only asked rows are taken"
    start, end = shadow.asked
    numel = 1
    for dim in shape:
        numel *= dim
    size = (end - start) * numel * torch.empty(0, dtype=dtype).element_size()
    if (part.start, part.count) != (start, end - start):
        raise ValueError(f"rows [{part.start}, +{part.count}), not asked")
    raw = gather(shadow.arriving, part.offset, part.data, size)
    if raw is None:
        return None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(end - start, *shape)
