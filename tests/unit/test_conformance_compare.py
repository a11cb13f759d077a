"""`bench conformance`'s comparison of two greedy answers: equal, a near tie, a real parting."""

from __future__ import annotations

from seamline_bench.conformance_compare import Answer, compare, summarise


def _top(*pairs: tuple[int, float]) -> dict[int, float]:
    return dict(pairs)


def test_equal_answers_with_close_logits() -> None:
    ours = Answer([5, 6], [_top((5, -0.1), (7, -2.0)), _top((6, -0.5), (8, -1.0))])
    ref = Answer([5, 6], [_top((5, -0.12), (7, -2.0)), _top((6, -0.5), (8, -1.05))])
    row = compare(ours, ref)
    assert row.equal and row.parted_at is None and not row.near_tie
    assert abs(row.max_logit_diff - 0.05) < 1e-9 and row.top5_equal


def test_an_answer_cut_at_an_end_token_is_equal_to_its_longer_twin() -> None:
    ours = Answer([5], [_top((5, -0.1), (7, -2.0))])
    ref = Answer([5, 6, 9], [_top((5, -0.1), (7, -2.0))] * 3)
    assert compare(ours, ref).equal


def test_a_parting_at_a_near_tie_is_told_from_a_real_one() -> None:
    first = _top((5, -0.1), (7, -3.0))
    # before parting the sides differ by 0.05; the reference's top-2 gap is 0.02 there
    tie = compare(
        Answer([5, 7], [_top((5, -0.15), (7, -3.0)), _top((7, -0.69), (6, -0.70))]),
        Answer([5, 6], [first, _top((6, -0.68), (7, -0.70))]),
    )
    assert not tie.equal and tie.parted_at == 1 and tie.near_tie
    assert tie.reference_gap is not None and abs(tie.reference_gap - 0.02) < 1e-9
    assert abs(tie.max_logit_diff - 0.05) < 1e-9  # the parting position's own is left out
    real = compare(
        Answer([5, 7], [first, _top((7, -0.1), (6, -3.0))]),
        Answer([5, 6], [first, _top((6, -0.1), (7, -3.0))]),
    )
    assert not real.equal and not real.near_tie and real.max_logit_diff == 0.0
    figures = summarise([tie, real])
    assert figures == {
        "prompts": 2,
        "greedy_equal": 0,
        "near_ties": 1,
        "unexplained_partings": 1,
        "top5_equal": 2,
        "max_logit_diff": 0.05,
    }


def test_a_file_wide_difference_explains_a_parting_at_the_first_token() -> None:
    """A prompt that parts at once has no difference of its own measured: the file's counts."""
    at_once = compare(
        Answer([7], [_top((7, -0.7), (6, -0.71))]), Answer([6], [_top((6, -0.69), (7, -0.7))])
    )
    assert not at_once.near_tie and at_once.max_logit_diff == 0.0
    noisy = compare(
        Answer([5], [_top((5, -0.1), (7, -2.0))]), Answer([5], [_top((5, -0.2), (7, -2.0))])
    )
    assert summarise([at_once, noisy])["near_ties"] == 1


def test_a_probability_of_zero_is_no_measurement() -> None:
    """llama-server lists a token of probability zero at the lowest float: not a difference."""
    ours = Answer([5], [_top((5, -0.1), (7, -40.0))])
    ref = Answer([5], [_top((5, -0.1), (7, -3.4028234663852886e38))])
    assert compare(ours, ref).max_logit_diff == 0.0


def test_a_parting_where_the_reference_gave_no_log_probabilities_is_judged_by_ours() -> None:
    """llama-server lists nothing for a token that ends inside a UTF-8 character: there the gap
    between our token and the reference's, in our log-probabilities, decides."""
    first = (_top((5, -0.1), (7, -3.0)), _top((5, -0.12), (7, -3.0)))  # 0.02 apart before
    close = compare(
        Answer([5, 7], [first[0], _top((7, -0.70), (6, -0.71), (9, -5.0))]),
        Answer([5, 6], [first[1], {}]),
    )
    assert close.near_tie and close.gap_from == "seamline"
    assert close.reference_gap is not None and abs(close.reference_gap - 0.01) < 1e-9
    far = compare(
        Answer([5, 7], [first[0], _top((7, -0.1), (9, -3.0), (6, -4.0))]),
        Answer([5, 6], [first[1], {}]),
    )
    assert not far.near_tie and far.gap_from == "seamline"
    assert far.reference_gap is not None and abs(far.reference_gap - 3.9) < 1e-9
    unseen = compare(
        Answer([5, 7], [first[0], _top((7, -0.1), (9, -3.0))]), Answer([5, 6], [first[1], {}])
    )
    assert unseen.reference_gap is None and unseen.gap_from is None and not unseen.near_tie
