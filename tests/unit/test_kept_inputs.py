"""A checked stage's kept input rows (``runtime.kept_inputs``): one row per position, replaced
from where a sequence starts over or goes back, a fork's beginning with its donor's;
a forgotten request's kept a while."""

from __future__ import annotations

import time

import pytest
import torch

from seamline.runtime import kept_inputs
from seamline.runtime.kept_inputs import KeptInputs


def _rows(first: int, count: int) -> torch.Tensor:
    return torch.arange(first, first + count, dtype=torch.float32).view(count, 1).repeat(1, 3)


def test_rows_are_kept_by_position_and_shown_across_frames() -> None:
    kept = KeptInputs()
    kept.keep(1, 0, _rows(0, 5))
    kept.keep(1, 5, _rows(5, 1))
    kept.keep(1, 6, _rows(6, 1))
    assert torch.equal(kept.rows(1, 3, 7), _rows(3, 4))  # type: ignore[arg-type]
    assert kept.rows(1, 3, 8) is None  # position 7 never came
    assert kept.rows(2, 0, 1) is None


def test_a_sequence_that_starts_over_replaces_what_came_before() -> None:
    kept = KeptInputs()
    kept.keep(1, 0, _rows(0, 5))
    kept.keep(1, 0, _rows(10, 2))
    assert torch.equal(kept.rows(1, 0, 2), _rows(10, 2))  # type: ignore[arg-type]
    assert kept.rows(1, 0, 3) is None


def test_a_fork_begins_with_its_donors_rows() -> None:
    kept = KeptInputs()
    kept.keep(1, 0, _rows(0, 6))
    kept.fork(2, 1, 4)
    kept.keep(2, 4, _rows(40, 1))
    assert torch.equal(kept.rows(2, 0, 5), torch.cat([_rows(0, 4), _rows(40, 1)]))  # type: ignore[arg-type]
    kept.forget(1)
    kept.forget(2)
    assert torch.equal(kept.rows(2, 0, 4), _rows(0, 4))  # type: ignore[arg-type]


def test_a_forgotten_requests_rows_stay_a_while_within_a_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stage 0 may evict a finished request's cache before the coordinator asks for its rows."""
    kept = KeptInputs()
    kept.keep(1, 0, _rows(0, 4))
    kept.forget(1)
    assert torch.equal(kept.rows(1, 0, 4), _rows(0, 4))  # type: ignore[arg-type]
    monkeypatch.setattr(kept_inputs, "AFTER_FORGET_BYTES", 2 * _rows(0, 4).nbytes)
    for request in (2, 3):
        kept.keep(request, 0, _rows(0, 4))
        kept.forget(request)
    assert kept.rows(1, 0, 4) is None and kept.rows(3, 0, 4) is not None  # the oldest went
    monkeypatch.setattr(kept_inputs, "AFTER_FORGET_S", 0.0)
    time.sleep(0.01)
    assert kept.rows(3, 0, 4) is None and kept.requests() == 0


def test_kept_rows_are_copies_not_views_of_the_frame() -> None:
    frame = _rows(0, 4)
    kept = KeptInputs()
    kept.keep(1, 0, frame[1:3])
    frame.zero_()
    assert torch.equal(kept.rows(1, 0, 2), _rows(1, 2))  # type: ignore[arg-type]
