"""How the cost model prices a step from a stage's probes: decode rows, prompt chunks of any
length, and steps that mix the two."""

from __future__ import annotations

import math

from seamline.sim.costs import DeviceSpeed

READ = 1e8  # weight bytes a row reads
# as a probe gives them: a step of 1, 16 and 64 decode rows; prompt chunks of 32 and 256 rows
SPEED = DeviceSpeed(
    bytes_per_second=1e10, batched={16: 8e10, 64: 2e11}, prompt={32: 1.6e11, 256: 4e11}
)


def seconds(rows: int, rate: float) -> float:
    return rows * READ / rate


def test_a_probed_prompt_chunk_costs_what_the_probe_took() -> None:
    assert math.isclose(SPEED.step_s(READ, 32, 32), seconds(32, 1.6e11))
    assert math.isclose(SPEED.step_s(READ, 256, 256), seconds(256, 4e11))


def test_a_short_chunk_is_dearer_per_row_than_a_long_one_and_one_row_is_a_decode_step() -> None:
    assert math.isclose(SPEED.step_s(READ, 1, 1), SPEED.step_s(READ, 1))
    per_row = [SPEED.step_s(READ, rows, rows) / rows for rows in (1, 8, 32, 64, 128, 256)]
    assert per_row == sorted(per_row, reverse=True) and per_row[2] > 2 * per_row[-1]
    # between the probed lengths, linear in log2(rows): 64 rows is a third of the way from 32 to 256
    assert math.isclose(SPEED.prompt_rate(64), 1.6e11 + (4e11 - 1.6e11) / 3)
    assert math.isclose(
        SPEED.step_s(READ, 512, 512), seconds(512, 4e11)
    )  # past the longest: its rate


def test_a_mixed_step_shares_its_matmuls() -> None:
    """16 decode rows beside a 112-row chunk: 128 rows at the prompt rate, and the decode rows'
    extra over as many prompt rows; less than the two kinds stepped apart, more than the chunk."""
    decode_extra = seconds(16, 8e10) - seconds(16, SPEED.prompt_rate(16))
    mixed = SPEED.step_s(READ, 128, 112)
    assert math.isclose(mixed, seconds(128, SPEED.prompt_rate(128)) + decode_extra)
    assert (
        SPEED.step_s(READ, 112, 112) < mixed < SPEED.step_s(READ, 16) + SPEED.step_s(READ, 112, 112)
    )


def test_no_prompt_probe_prices_prompt_rows_as_decode_rows() -> None:
    plain = DeviceSpeed(bytes_per_second=1e10, batched={16: 8e10, 64: 2e11})
    assert math.isclose(plain.step_s(READ, 48, 32), plain.step_s(READ, 48))
