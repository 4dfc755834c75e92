"""Schedules as data: golden grids (reviewed like code), round trips, invariants."""

from __future__ import annotations

import pytest

from clustersim.schedule import build_schedule, format_grid, parse_grid, unit_time_grid

GOLDEN_1F1B_4x8 = """\
rank 0  | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
rank 1  | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
rank 2  | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
rank 3  | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  ."""

GOLDEN_GPIPE_3x4 = """\
rank 0  | F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3
rank 1  | .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .
rank 2  | .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  ."""


def test_golden_grids():
    assert format_grid(build_schedule("1f1b", 4, 8)) == GOLDEN_1F1B_4x8
    assert format_grid(build_schedule("gpipe", 3, 4)) == GOLDEN_GPIPE_3x4


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 5), (4, 3), (5, 12)])
def test_round_trip_and_invariants(name, p, m):
    s = build_schedule(name, p, m)
    assert parse_grid(format_grid(s)) == s
    for acts in s:  # every microbatch forward once and backward once, forward first
        assert sorted((a.kind, a.mb) for a in acts) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(acts.index(type(a)("F", a.mb)) < i for i, a in enumerate(acts) if a.kind == "B")
    # unit time: 2(m + p - 1) slots, every rank idle 2(p-1)
    grid = unit_time_grid(s)
    assert all(len(row) == 2 * (m + p - 1) for row in grid)
    assert all(row.count(None) == 2 * (p - 1) for row in grid)


def test_1f1b_warmup_is_p_minus_rank_minus_one():
    s = build_schedule("1f1b", 4, 8)
    for rank, acts in enumerate(s):
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        assert first_b == 4 - rank  # (p - rank - 1) warm-up forwards, then one more F before the first B


def test_unknown_schedule():
    with pytest.raises(KeyError, match="unknown schedule"):
        build_schedule("zigzag", 2, 2)
