"""The checks of what crossed between stages (``verify``), which need no computing: each link's
digests, and the rows a chosen stage shows; a disagreement is settled by the signed statement
of the frame (``link_blame``). ``Verifier`` takes these methods."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from seamline.mesh.control.link_blame import Crossing, liars
from seamline.mesh.control.reference import AnyStage, Reference
from seamline.mesh.control.verify_shadow import Shadow
from seamline.runtime import digest


@dataclass(frozen=True)
class CheckedStage:
    layers: tuple[int, int]
    nodes: tuple[str, ...]  # its leader first (who reports), then a group's other ranks


class CrossingChecks:
    """Mixed into ``Verifier``."""

    stages: list[CheckedStage]
    seed: int
    public_keys: Callable[[str], list[Any]]
    _ref: Reference
    _stage: Callable[[int], AnyStage]
    _fault: Callable[[list[int], str], bool]

    def _link_holds(
        self, shadow: Shadow, index: int, position: int, count: int, got: dict[int, torch.Tensor]
    ) -> bool:
        """Whether what stage ``index`` reports taking is what the stage before reports sending
        (no computing); where not, the one of the two that lied is at fault (``link_blame``)."""
        took, sent = got[index][0], got[index - 1][1]
        scale = max(float(took.norm()), float(sent.norm()))  # the sums' scale, near enough
        crossing = Crossing(
            (shadow.request, position, count),
            took,
            sent,
            scale,
            self._ref.dtype,
            self._ref.rows_alone,
        )
        if digest.differs(took, sent, scale, crossing.dtype, crossing.rows_alone) <= 1:
            return True
        return self._crossing_holds(shadow, index, crossing, "what crossed to")

    def _shown_holds(
        self,
        shadow: Shadow,
        position: int,
        count: int,
        got: dict[int, torch.Tensor],
        shown: torch.Tensor,
    ) -> bool:
        """Whether the rows the chosen stage shows are those it reported taking, and those its
        sender signed (a plaintext mesh: reported sending); otherwise who lied is at fault."""
        index = shadow.chosen
        took = digest.digest(shown, position, self.seed)
        scale = digest.scale(shown, position, self.seed)
        dtype, alone = self._stage(index).compute_dtype, self._ref.rows_alone
        if digest.differs(got[index][0], took, scale, dtype, alone) > 1:
            return self._fault(
                [index],
                f"the rows it shows for positions [{position}, {position + count}) are not "
                "those whose digest it reported",
            )
        crossing = Crossing(
            (shadow.request, position, count), took, got[index - 1][1], scale, dtype, alone
        )
        sender = self.stages[index - 1].nodes[0]
        if (
            not self.public_keys(sender)
            and digest.differs(took, got[index - 1][1], scale, dtype, alone) <= 1
        ):
            return True
        return self._crossing_holds(shadow, index, crossing, "the rows shown by")

    def _crossing_holds(self, shadow: Shadow, index: int, crossing: Crossing, what: str) -> bool:
        """A disagreement on what crossed to stage ``index``, settled by the signed statement of
        its frame: True when the statement shows they agree after all."""
        sender = self.stages[index - 1].nodes[0]
        _, position, count = crossing.row
        statement = shadow.statements.get((position, count), {}).get(index)
        who, why = liars(crossing, sender, self.public_keys(sender), self.seed, statement)
        if not who:
            return True
        places = {"sender": index - 1, "receiver": index}
        return self._fault(
            [places[w] for w in who],
            f"{what} layers {self.stages[index].layers} for positions "
            f"[{position}, {position + count}) is not what crossed from the stage before: {why}",
        )
