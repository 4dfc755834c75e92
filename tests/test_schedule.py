"""Schedules as data: golden grids (reviewed like code), round trips, invariants."""

from __future__ import annotations

import pytest

from clustersim.schedule import build_schedule, format_grid, parse_grid, unit_time_grid

GOLDEN_1F1B_4x8 = """\
rank 0  | 0F0 0F1 0F2 0F3 .   .   .   0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 .   0B5 .   0B6 .   0B7
rank 1  | .   1F0 1F1 1F2 .   .   1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 .   1B6 .   1B7 .
rank 2  | .   .   2F0 2F1 .   2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 .   2B7 .   .
rank 3  | .   .   .   3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 .   .   ."""

GOLDEN_GPIPE_3x4 = """\
rank 0  | 0F0 0F1 0F2 0F3 .   .   .   .   0B0 0B1 0B2 0B3
rank 1  | .   1F0 1F1 1F2 1F3 .   .   1B0 1B1 1B2 1B3 .
rank 2  | .   .   2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3 .   ."""


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
        assert all(acts.index(type(a)(a.stage, "F", a.mb)) < i for i, a in enumerate(acts) if a.kind == "B")
    # unit time: 2(m + p - 1) slots, every rank idle 2(p-1)
    grid = unit_time_grid(s)
    assert all(len(row) == 2 * (m + p - 1) for row in grid)
    assert all(row.count(None) == 2 * (p - 1) for row in grid)


def test_1f1b_warmup_is_p_minus_rank_minus_one():
    s = build_schedule("1f1b", 4, 8)
    for rank, acts in enumerate(s):
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        assert first_b == 4 - rank  # (p - rank - 1) warm-up forwards, then one more F before the first B


def test_deadlocking_order_is_refused():
    from clustersim.schedule import Action

    # stage 1 wants microbatch 1 before 0, stage 0 sends 0 first and then waits on 1B0
    bad = [[Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
           [Action(1, "F", 1), Action(1, "B", 1), Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        unit_time_grid(bad)


def test_unknown_schedule():
    with pytest.raises(KeyError, match="unknown schedule"):
        build_schedule("zigzag", 2, 2)
