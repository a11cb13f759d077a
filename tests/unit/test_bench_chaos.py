"""`bench chaos`'s accounting, on answers whose times are known: which streams a failure
touched and how long each took to go on, what was lost, what changed against the calm answers."""

from __future__ import annotations

from pathlib import Path

from seamline_bench.chaos import ClientAnswer, Clients, _recoveries, _result, _whole


def _answer(
    client: int, began: float, times: list[float], text: str = "a", error: str = ""
) -> ClientAnswer:
    return ClientAnswer(
        client,
        began,
        ended=(times[-1] if times else began) + 0.01,
        text=text,
        error=error,
        token_times=times,
    )


def test_recovery_is_measured_per_stream_in_flight_at_the_failure() -> None:
    answers = [
        _answer(0, 0.0, [1.0, 2.0, 7.5, 8.0]),  # in flight at 5: its next token 2.5 s later
        _answer(1, 0.0, [1.0, 4.0]),  # done before the failure: untouched
        _answer(2, 6.0, [6.5, 7.0]),  # began after it: untouched
        _answer(3, 4.0, [4.5, 5.2]),  # in flight: 0.2 s
    ]
    assert sorted(round(r, 3) for r in _recoveries(answers, [{"at": 5.0}])) == [0.2, 2.5]


def test_lost_and_changed_answers_are_counted_against_the_calm_phase() -> None:
    load = Clients.__new__(Clients)
    load.count, load.tokens = 2, 4
    load.answers = [
        _answer(0, 1.0, [1.1, 1.2], "calm0"),
        _answer(1, 1.0, [1.1, 1.2], "calm1"),  # calm: 0..10
        _answer(0, 11.0, [11.5, 12.0], "calm0"),  # chaos, unchanged
        _answer(1, 11.0, [11.5, 12.0], "other"),  # chaos, changed
        _answer(0, 13.0, [], "", error="the mesh could not serve again"),  # chaos, lost
    ]
    result = _result(
        load, 0.0, 10.0, 20.0, [{"node": "n", "how": "SIGKILL", "at": 11.2}], 1, Path(".")
    )
    assert (result["requests"], result["lost"], result["outputs_changed"]) == (3, 1, 1)
    assert (
        result["near_tie_flips"] == 0
    )  # "other" is no near-tie of "calm1" (the reference model examined it)
    assert result["recovery_s_p50"] == 0.3 and result["streams_recovered"] == 2


def test_the_next_round_waits_for_every_node_to_be_checked_not_only_admitted() -> None:
    checked = [{"node_id": f"chaos{i}", "checked": True} for i in range(3)]
    joining = [*checked[:2], {"node_id": "chaos2", "checked": False}]  # admitted, being measured
    assert _whole({"ready": True, "nodes": checked})
    assert not _whole({"ready": True, "nodes": joining})
    assert not _whole({"ready": False, "nodes": checked})
    assert not _whole({})
