"""`bench growth`'s accounting, on answers whose times are known: the rate in each phase, what
was lost or changed against each client's first answer, the gain the coordinator predicted."""

from __future__ import annotations

from pathlib import Path

from seamline_bench.chaos import ClientAnswer, Clients
from seamline_bench.growth import _result


def test_rates_gain_and_losses_are_counted_per_phase(tmp_path: Path) -> None:
    (tmp_path / "growth.log").write_text(
        "... INFO: planning growth2 in: predicted 1.39x the throughput; ...\n"
    )
    load = Clients.__new__(Clients)
    load.count, load.tokens = 2, 4
    load.answers = [
        ClientAnswer(0, 0.5, 4.0, "a", token_times=[1.0, 2.0, 3.0]),  # before: 0..10, 4 tokens
        ClientAnswer(1, 0.5, 9.0, "b", token_times=[8.0]),
        ClientAnswer(0, 11.0, 13.0, "", error="lost"),  # during the switch
        ClientAnswer(
            0, 20.0, 22.0, "a", token_times=[20.5, 21.0, 21.5, 22.0]
        ),  # after: 20..25, 6 tokens
        ClientAnswer(1, 20.0, 24.0, "c", token_times=[23.0, 24.0]),  # changed
    ]
    result = _result(
        load, (0.0, 10.0), (20.0, 25.0), 3.5, ["g0", "g1"], ["g0", "g1", "g2"], tmp_path
    )
    assert (result["tok_s_before"], result["tok_s_after"], result["gain"]) == (0.4, 1.2, 3.0)
    assert (result["requests"], result["lost"], result["outputs_changed"]) == (5, 1, 1)
    assert result["predicted_gain"] == 1.39 and result["switch_s"] == 3.5
