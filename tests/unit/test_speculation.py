"""Drafts from n-grams, and how a sequence's draft length follows what it accepts."""

from __future__ import annotations

import pytest

from seamline.errors import ConfigError
from seamline.runtime.speculation import (
    MAX_PAUSE_STEPS,
    ROW_COST,
    Drafter,
    Speculation,
    SpeculationStats,
    StepCost,
    from_config,
    ngram_draft,
)


def test_a_draft_is_what_followed_the_latest_longest_match() -> None:
    history = [1, 2, 3, 4, 9, 9, 2, 3, 4, 5, 6, 7, 8, 2, 3, 4]
    assert ngram_draft(history, 3) == [5, 6, 7]  # [2, 3, 4] twice before: the latest one's sequel
    assert ngram_draft(history, 10) == [5, 6, 7, 8, 2, 3, 4]  # up to the end of what is known
    assert ngram_draft([5, 6, 7, 8], 4) == []  # nothing repeats
    assert ngram_draft([1, 2, 1, 2], 0) == []
    assert ngram_draft([7, 7, 7], 2) == [7]  # the match may overlap the suffix itself


def test_the_longest_suffix_wins_over_a_later_shorter_one() -> None:
    history = [1, 2, 3, 50, 60, 9, 3, 70, 1, 2, 3]
    assert ngram_draft(history, 2) == [
        50,
        60,
    ]  # [1, 2, 3] (not the later [3] alone: too short anyway)


def test_the_draft_length_grows_on_full_acceptance_and_pauses_after_misses() -> None:
    drafter = Drafter(draft_max=8, source=lambda history, limit: [0] * limit)
    assert drafter.propose([], room=8) == [0] * 8
    for token in [0] * 3:
        assert drafter.check(token)
    assert not drafter.check(5)
    assert drafter.close() == (8, 3)
    assert len(drafter.propose([], room=8)) == 4  # accepted + 1
    for _ in range(4):
        drafter.check(0)
    drafter.close()
    assert len(drafter.propose([], room=8)) == 8  # doubled, within draft_max
    assert len(drafter.propose([], room=3)) == 3  # within the room the step has
    pauses = []
    for _ in range(8):  # windows that accept nothing: shorter, then pauses that double
        drafter.propose([], room=8)
        drafter.close()
        pauses.append(drafter.pause)
        while drafter.pause:
            assert drafter.propose([], room=8) == []
    assert pauses[:2] == [0, 2] and pauses[-1] == MAX_PAUSE_STEPS and sorted(pauses) == pauses


def test_stats_count_windows_drafts_and_tokens_per_window() -> None:
    stats = SpeculationStats()
    stats.add(4, 4)
    stats.add(4, 0)
    stats.add(0, 0)  # no window was drafted
    assert (stats.windows, stats.drafted, stats.accepted) == (2, 8, 4)
    assert stats.acceptance == 0.5 and stats.tokens_per_window == 3.0


@pytest.mark.parametrize(
    "mode, draft_max, fragment",
    [
        ("sometimes", 4, "--speculative"),
        ("auto", 0, "--draft-max 0"),
        ("ngram", 99, "--draft-max 99"),
    ],
)
def test_bad_options_name_their_flag(mode: str, draft_max: int, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        Speculation(mode, draft_max)


def test_a_rows_cost_is_measured_from_steps_alone_and_cheap_rows_draft_more() -> None:
    cost = StepCost()
    assert cost.row_cost == ROW_COST  # nothing measured yet
    cost.observe(5, 0.030)  # a window before any one-row step: nothing to compare it with
    assert cost.row_cost == ROW_COST
    cost.observe(1, 0.010)
    cost.observe(5, 0.018)  # 2 ms a row over a 10 ms step
    assert cost.row_cost == pytest.approx(0.2)
    history = [1, 2, 3, 9, 5, 6, 7, 3]  # only "3" occurred before
    assert Drafter(draft_max=4).propose(history, room=4, row_cost=0.2) == []
    assert Drafter(draft_max=4).propose(history, room=4, row_cost=0.05) == [
        9,
        5,
        6,
        7,
    ]  # a step that waits on links


def test_a_vllm_speculative_config_names_a_mode_and_a_draft_length() -> None:
    assert from_config('{"method": "ngram", "num_speculative_tokens": 5}') == Speculation(
        "ngram", 5
    )
    assert from_config('{"method": "deepseek_mtp"}').mode == "mtp"
    looked_up = from_config(
        '{"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 1}'
    ).source
    assert looked_up([5, 6, 7, 5, 9, 6], 3) == [
        7,
        5,
        9,
    ]  # a one-token match, as prompt_lookup_min 1 allows
    assert (
        from_config('{"method": "ngram"}').source([5, 6, 7, 5, 9, 6], 3) == []
    )  # the default: 2 tokens at least
    assert from_config('{"model": "/m", "num_speculative_tokens": 4}') == Speculation(
        "auto", 4, draft_model="/m"
    )
    assert from_config('{"method": "draft_model", "model": "/m"}').draft_model == "/m"
    for text, why in (
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle"}', "method 'eagle'"),
        (
            '{"method": "ngram", "draft_tensor_parallel_size": 1}',
            "'draft_tensor_parallel_size' is not taken",
        ),
        ('{"method": "ngram", "prompt_lookup_min": 5}', "1 <= min <= max"),
        ('{"method": "ngram", "num_speculative_tokens": "5"}', "not a whole number"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "--draft-max 0"),
        ('{"method": "ngram", "model": "/m"}', "a draft model takes method 'draft_model'"),
        ('{"method": "draft_model"}', "got method 'draft_model' and model None"),
    ):
        with pytest.raises(ConfigError, match=why):
            from_config(text)


def test_token_frames_carry_the_last_stages_drafts_after_the_log_probabilities() -> None:
    """A TOKEN frame's rows flagged DRAFTS carry the model's drafts for the next window; a
    frame cut inside them is refused; a HIDDEN row's flags ask for up to 255 drafts."""
    from seamline.net.frames import (
        HEADER,
        FrameError,
        RowFlag,
        TokenRow,
        asking_drafts,
        decode_tokens,
        drafts_wanted,
        encode_tokens,
    )

    rows = [
        TokenRow(
            1,
            10,
            5,
            7,
            8,
            RowFlag.LOGPROBS | RowFlag.DRAFTS,
            -0.5,
            ((5, -0.5), (6, -1.0)),
            (9, 3, 4),
        ),
        TokenRow(2, 3, 6, 1, 2, int(RowFlag.DONE)),
        TokenRow(3, 4, 7, 1, 2, int(RowFlag.DRAFTS), drafts=(11,)),
    ]
    payload = encode_tokens(rows)[HEADER.size :]
    back = decode_tokens(payload).rows
    assert [r.drafts for r in back] == [(9, 3, 4), (), (11,)]
    assert back[0].top == ((5, -0.5), (6, -1.0)) and back[0].logprob == -0.5
    with pytest.raises(FrameError, match="too short for 1 drafts"):
        decode_tokens(payload[:-1])
    flags = asking_drafts(int(RowFlag.SAMPLE | RowFlag.WINDOW), 6)
    assert drafts_wanted(flags) == 6 and flags & 0xFF == RowFlag.SAMPLE | RowFlag.WINDOW
    assert (
        drafts_wanted(asking_drafts(flags, 400)) == 255
        and drafts_wanted(asking_drafts(flags, 0)) == 0
    )
