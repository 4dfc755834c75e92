"""Schedules as data: golden grids (reviewed like code), round trips, invariants, closed forms."""

from __future__ import annotations

import itertools

import pytest

from clustersim.schedule import (
    CUSTOM,
    SCHEDULES,
    Action,
    PipelineSchedule,
    ScheduleError,
    action_deps,
    build_schedule,
    format_grid,
    idle_per_rank,
    interleaved_warmup,
    parse_grid,
    peak_in_flight,
    timeline,
    unit_time_grid,
)
from clustersim.schedule.classic import interleaved_table
from clustersim.schedule.core import split_weight_passes

GOLDEN_1F1B_4x8 = """\
rank 0  | 0F0 0F1 0F2 0F3 .   .   .   0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 .   0B5 .   0B6 .   0B7
rank 1  | .   1F0 1F1 1F2 .   .   1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 .   1B6 .   1B7 .
rank 2  | .   .   2F0 2F1 .   2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 .   2B7 .   .
rank 3  | .   .   .   3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 .   .   ."""

GOLDEN_GPIPE_3x4 = """\
rank 0  | 0F0 0F1 0F2 0F3 .   .   .   .   0B0 0B1 0B2 0B3
rank 1  | .   1F0 1F1 1F2 1F3 .   .   1B0 1B1 1B2 1B3 .
rank 2  | .   .   2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3 .   ."""

# Narayanan et al. SC'21 (arXiv:2104.04473) Fig. 4, bottom: p=4, v=2, m=8. Stage k = chunk
# k // 4 on rank k % 4. Rank 0 runs (p-1)*2 + (v-1)*p = 10 warm-up forwards: microbatches
# 0-3 on chunk 0, 0-3 on chunk 1, then 4-5 on chunk 0; backwards start at the last chunk.
# Every rank idles 2(p-1) = 6 chunk slots, (p-1)(F+B)/v of a full stage.
GOLDEN_INTERLEAVED_4x8_V2 = """\
rank 0  | 0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 .   .   4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 0B2 0B3 .   4B4 .   4B5 .   4B6 .   4B7 0B4 0B5 0B6 0B7
rank 1  | .   1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 1B2 5F7 1B3 .   5B4 .   5B5 .   5B6 .   5B7 1B4 1B5 1B6 1B7 .
rank 2  | .   .   2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 2B3 6F6 6B4 6F7 6B5 .   6B6 .   6B7 2B4 2B5 2B6 2B7 .   .
rank 3  | .   .   .   3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7 .   .   ."""

# Qi et al. 2023 (arXiv:2401.10241) Fig. 3, ZB-H1, p=4: 1F1B's warm-up and F/B steady state;
# rank r runs the W of backward i - r after backward i, so rank 3 (the last) holds three W's
# back and runs them in its cool-down. Every rank idles p-1 = 3 slots (1F1B: 3(p-1) with
# B = W = 1) and holds at most p = 4 microbatches until their W.
GOLDEN_ZBH1_4x8 = """rank 0  | 0F0 0F1 0F2 0F3 .   .   .   0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7
rank 1  | .   1F0 1F1 1F2 .   .   1B0 1F3 1B1 1W0 1F4 1B2 1W1 1F5 1B3 1W2 1F6 1B4 1W3 1F7 1B5 1W4 1B6 1W5 1B7 1W6 1W7
rank 2  | .   .   2F0 2F1 .   2B0 2F2 2B1 2F3 2B2 2W0 2F4 2B3 2W1 2F5 2B4 2W2 2F6 2B5 2W3 2F7 2B6 2W4 2B7 2W5 2W6 2W7
rank 3  | .   .   .   3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 3B4 3W1 3F5 3B5 3W2 3F6 3B6 3W3 3F7 3B7 3W4 3W5 3W6 3W7"""

# DeepSeek-V3 report (arXiv:2412.19437) Fig. 5 (drawn there for p=8, m=20); p=4, m=8 is the
# smallest legal size (m >= 2p). Order = the reference implementation's eight steps. Stages
# 0-3: direction 0, microbatches 0-3, ranks 0 -> 3; stages 4-7: direction 1, microbatches 4-7,
# ranks 3 -> 0 (stage 4+j computes part j on rank 3-j). "&" marks a full backward overlapped
# with the forward before it (F&B chunk, drawn F, B, W in unit time); the middle ranks 1 and 2
# run their first step-4 pair without overlap, as the reference does. A full backward written B
# then W sends its gradient when its W ends, as the reference's _backward_chunk(enable_zb=False)
# does (so ranks 1 and 2 wait a slot for 7B7 7W7 and 4B7 4W7 before 6B7 and 5B7). Each rank
# idles (p/2-1)(F&B + B - 3W) = 2 slots with F&B = 3, B = 2 (full), W = 1.
GOLDEN_DUALPIPE_4x8 = """rank 0  | 0F0  0F1  0F2  7F4  7I4  7W4  7F5  0F3  &7B5 7W5  .    7F6  &0B0 0W0  7B6  7W6  .    7F7  &0B1 0W1  7B7  7W7  0I2  0W2  0I3  0W3
rank 1  | .    1F0  6F4  1F1  6F5  1F2  6B4  6W4  6F6  &1B0 1W0  1F3  &6B5 6W5  6F7  &1B1 1W1  6B6  6W6  1B2  1W2  .    6B7  1B3  6W7  1W3
rank 2  | .    5F4  2F0  5F5  2F1  5F6  2B0  2W0  2F2  &5B4 5W4  5F7  &2B1 2W1  2F3  &5B5 5W5  2B2  2W2  5B6  5W6  .    2B3  5B7  2W3  5W7
rank 3  | 4F4  4F5  4F6  3F0  3I0  3W0  3F1  4F7  &3B1 3W1  .    3F2  &4B4 4W4  3B2  3W2  .    3F3  &4B5 4W5  3B3  3W3  4I6  4W6  4I7  4W7"""


# Qi et al. 2023 (arXiv:2401.10241) Sec 6, ZB-V, p=4, m=8: the model in 2p = 8 chunks placed as a V
# (rank r holds stages r and 7-r; a microbatch goes 0 -> 3 down the ranks, 4 -> 7 back up, its
# loss on rank 0). Rank r: 2(p-r)-1 forwards of its first chunk, r pairs F(second) F(first),
# p-r full F B W of its second chunk, then F B W of each chunk in turn; in the cool-down r
# pairs of B's hold their W's back, p-r B W's, and the held W's run last. Every rank idles
# p-1 = 3 chunk slots (ZB-H1: p-1 full-stage slots, twice as long) and holds at most 2p = 8
# chunks' activations, half a stage each: 1F1B's peak.
GOLDEN_ZBV_4x8 = """rank 0  | 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0 0W0 7F4 7I4 7W4 0I1 0W1 7F5 7I5 7W5 0I2 0W2 7F6 7I6 7W6 0I3 0W3 7F7 7I7 7W7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7 .   .   .
rank 1  | .   1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1F6 1I0 1W0 6F4 6I3 6W3 1F7 1I1 1W1 6F5 6I4 6W4 1I2 1W2 6F6 6I5 6W5 1I3 1W3 6F7 6I6 6W6 1B4 6B7 1B5 1W4 1B6 1W5 1B7 1W6 6W7 1W7 .   .
rank 2  | .   .   2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 5I1 5W1 2F5 2I0 2W0 5F4 5I2 5W2 2F6 2I1 2W1 5F5 5I3 5W3 2F7 2I2 2W2 5F6 5I4 5W4 2I3 2W3 5F7 5I5 5W5 2B4 5B6 2B5 5B7 2B6 2W4 2B7 2W5 5W6 5W7 2W6 2W7 .
rank 3  | .   .   .   3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 4I2 4W2 3F6 3I2 3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 4W4 3B4 4B5 3B5 4B6 3B6 4B7 3B7 3W4 4W5 4W6 4W7 3W5 3W6 3W7"""


def test_golden_grids():
    assert format_grid(build_schedule("1f1b", 4, 8)) == GOLDEN_1F1B_4x8
    assert format_grid(build_schedule("gpipe", 3, 4)) == GOLDEN_GPIPE_3x4
    assert format_grid(build_schedule("interleaved", 4, 8, v=2)) == GOLDEN_INTERLEAVED_4x8_V2
    assert format_grid(build_schedule("zb-h1", 4, 8)) == GOLDEN_ZBH1_4x8
    assert format_grid(build_schedule("dualpipe", 4, 8)) == GOLDEN_DUALPIPE_4x8
    assert format_grid(build_schedule("zbv", 4, 8)) == GOLDEN_ZBV_4x8


def test_gpipe_and_1f1b_action_lists_unchanged():
    """The lowering walks these lists: they must stay exactly what they were."""
    p, m = 4, 6
    gp = [[Action(s, "F", i) for i in range(m)] + [Action(s, "B", i) for i in range(m)] for s in range(p)]
    assert [list(r) for r in build_schedule("gpipe", p, m)] == gp
    # p-s-1 warm-up forwards, then F/B pairs, then the draining backwards (written out by hand)
    one = """\
0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5
1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5
2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5
3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"""
    assert [" ".join(map(str, r)) for r in build_schedule("1f1b", p, m)] == one.splitlines()


# (name, p, m, opts) over many shapes, including m < p and m == p
CASES = (
    [(n, p, m, {}) for n in ("gpipe", "1f1b", "zb-h1") for p, m in [(1, 1), (2, 5), (4, 3), (4, 4), (5, 12), (8, 8)]]
    + [("interleaved", p, m, {"v": v}) for p, m, v in [(2, 2, 2), (2, 6, 3), (3, 3, 2), (4, 4, 2),
                                                       (4, 8, 2), (4, 12, 3), (8, 16, 4)]]
    + [("dualpipe", p, m, {}) for p, m in [(2, 4), (2, 6), (4, 8), (4, 10), (6, 12), (8, 20)]]
    + [("zbv", p, m, {}) for p, m in [(2, 1), (2, 3), (2, 5), (4, 3), (4, 8), (5, 12), (8, 16)]]
    + [("dualpipev", p, m, {}) for p, m in [(2, 4), (2, 5), (3, 6), (4, 8), (4, 11), (8, 16)]]
)
CASE_IDS = [f"{n}-p{p}-m{m}" + "".join(f"-{k}{v}" for k, v in o.items()) for n, p, m, o in CASES]


@pytest.mark.parametrize("name,p,m,opts", CASES, ids=CASE_IDS)
def test_round_trip(name, p, m, opts):
    s = build_schedule(name, p, m, **opts)
    text = format_grid(s)
    back = parse_grid(text, stage_part=s.stage_part)
    assert back == s  # actions, parts, overlapped chunks
    # and which backwards are split: a split B right before its W is written I
    assert [split_weight_passes(back, r) for r in range(p)] == [split_weight_passes(s, r) for r in range(p)]
    if name != "dualpipe":  # stage k computes part k: the grid alone says everything
        assert parse_grid(text) == s
    # the same schedule as torch-style CSV (empty cells idle) reads back identically
    csv = "\n".join(",".join("" if c == "." else c for c in line.split("| ", 1)[1].split())
                    for line in text.splitlines())
    assert parse_grid(csv, stage_part=s.stage_part).actions == s.actions


@pytest.mark.parametrize("name,p,m,opts", CASES, ids=CASE_IDS)
def test_invariants(name, p, m, opts):
    s = build_schedule(name, p, m, **opts)
    v = opts.get("v", 2 if name in ("dualpipe", "zbv", "dualpipev") else 1)
    assert s.ranks == p and s.n_microbatches == m
    assert s.n_stages == p * v
    assert s.n_parts == (p if name == "dualpipe" else p * v)
    assert s.split_backward == (name in ("zb-h1", "zbv", "dualpipe", "dualpipev"))
    kinds = ("F", "B", "W") if s.split_backward else ("F", "B")
    for r, acts in enumerate(s.actions):
        assert all(s.stage_rank[a.stage] == r for a in acts)
        for stage in s.stages_of(r):
            mbs = sorted({a.mb for a in acts if a.stage == stage})
            for mb in mbs:  # F, B, (W) exactly once each, in that order on the row
                idx = [i for i, a in enumerate(acts) if a.stage == stage and a.mb == mb]
                assert [acts[i].kind for i in idx] == list(kinds)
    for mb, path in enumerate(s.paths):  # each microbatch computes every part once, in model order
        assert [s.stage_part[k] for k in path] == list(range(s.n_parts))
        assert all(Action(k, "F", mb) in s.actions[s.stage_rank[k]] for k in path)
    grid = unit_time_grid(s)
    assert sorted(a for row in grid for a in row if a) == sorted(a for acts in s for a in acts)


def test_interleaved_warmup_is_megatrons():
    p, m, v = 4, 8, 2
    s = build_schedule("interleaved", p, m, v=v)
    for r, acts in enumerate(s.actions):
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        assert first_b == (p - r - 1) * 2 + (v - 1) * p + 1  # warm-up, then one F before the first B
        assert acts[first_b].stage == (v - 1) * p + r  # backwards start on the rank's last chunk
    # microbatches are taken p at a time per chunk: 0-3 on chunk 0, 0-3 on chunk 1, 4-7 ...
    assert [str(a) for a in s.actions[0][:10]] == ["0F0", "0F1", "0F2", "0F3", "4F0", "4F1", "4F2", "4F3",
                                                   "0F4", "0F5"]
    assert interleaved_warmup(4, 4, 2, 3) == 8  # m == p: every forward first, as Megatron-LM does
    assert interleaved_warmup(4, 8, 3, 0) == 14 and interleaved_warmup(2, 2, 4, 0) == 8  # capped at m*v


def test_1f1b_warmup_is_p_minus_rank_minus_one():
    s = build_schedule("1f1b", 4, 8)
    for rank, acts in enumerate(s):
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        assert first_b == 4 - rank  # (p - rank - 1) warm-up forwards, then one more F before the first B


# --- closed forms: idle time per rank (the bubble) against the reference formulas ----------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 5), (4, 3), (4, 8), (8, 16)])
@pytest.mark.parametrize("F,B", [(1, 1), (1, 2), (3, 5)])
def test_bubble_gpipe_1f1b(name, p, m, F, B):
    assert idle_per_rank(build_schedule(name, p, m), {"F": F, "B": B}) == [(p - 1) * (F + B)] * p


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3), (3, 6, 2), (8, 16, 4)])
@pytest.mark.parametrize("F,B", [(1, 1), (1, 2)])
def test_bubble_interleaved(p, m, v, F, B):
    """(p-1)(F+B)/v with F, B a whole stage's times; a chunk takes F/v and B/v."""
    s = build_schedule("interleaved", p, m, v=v)
    F_stage, B_stage = F * v, B * v  # durations below are per chunk
    assert idle_per_rank(s, {"F": F, "B": B}) == [pytest.approx((p - 1) * (F_stage + B_stage) / v)] * p
    ideal = m * (F_stage + B_stage)
    assert idle_per_rank(s, {"F": F, "B": B})[0] / ideal == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (5, 12), (8, 8), (8, 24)])
@pytest.mark.parametrize("F,B_in,W", [(1, 1, 1), (2, 2, 2), (1, 2, 1), (2, 1, 1)])
def test_bubble_zb_h1(p, m, F, B_in, W):
    """(p-1)(F + B - 2W) with B the full backward (B_in + W): (p-1)(F + B_in - W).

    The paper's handcrafted schedules assume T_F = T_B = T_W; it stays exact while W fits in
    the cool-down gaps (W <= F, W <= B_in), checked here for m >= p.
    """
    s = build_schedule("zb-h1", p, m)
    B = B_in + W
    assert idle_per_rank(s, {"F": F, "B": B_in, "W": W}) == [(p - 1) * (F + B - 2 * W)] * p
    one = build_schedule("1f1b", p, m)  # the same B + W as one full backward
    assert idle_per_rank(one, {"F": F, "B": B}) == [(p - 1) * (F + B)] * p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (6, 12), (8, 16), (8, 20)])
@pytest.mark.parametrize("fb", [2, 2.5, 3])
def test_bubble_dualpipe(p, m, fb):
    """(p/2-1)(F&B + B - 3W), F = B_in = W = 1, B = 2 the full backward.

    F&B is one forward chunk overlapped with one full backward chunk: a single unit on the
    rank that starts when both inputs are there and releases both outputs at its end. With
    F&B = F + B (= 3, no gain from overlap) every rank idles the formula; with a gain
    (F&B < 3, down to max(F, B) = 2) the middle ranks still do and the end ranks less.
    """
    s = build_schedule("dualpipe", p, m)
    idle = idle_per_rank(s, {"F": 1, "B": 1, "W": 1, "F&B": fb})
    formula = (p / 2 - 1) * (fb + 2 - 3 * 1)
    assert max(idle) == pytest.approx(formula)
    assert idle[p // 2] == pytest.approx(formula)
    if fb == 3:
        assert idle == [pytest.approx(formula)] * p
        assert idle == idle_per_rank(s)  # F&B defaults to the sum of its parts


@pytest.mark.parametrize("p,m", [(2, 3), (2, 8), (4, 7), (4, 8), (4, 12), (8, 15), (8, 24)])
@pytest.mark.parametrize("t", [1, 2])
def test_bubble_zbv_is_half_zb_h1_at_the_same_memory(p, m, t):
    """ZB-V with T_F = T_B = T_W = t per chunk (half a stage): every rank idles p-1 chunk
    slots, r before its first action and p-1-r after its last, (p-1) t. ZB-H1 on the same
    model (a stage's F = B = W = 2t) idles (p-1) 2t: twice as long. Both hold 1F1B's peak:
    2p half-stage chunks against p stages, once m >= 2p - 1."""
    zbv, zbh1 = build_schedule("zbv", p, m), build_schedule("zb-h1", p, m)
    assert idle_per_rank(zbv, {"F": t, "B": t, "W": t}) == [(p - 1) * t] * p
    assert idle_per_rank(zbh1, {"F": 2 * t, "B": 2 * t, "W": 2 * t}) == [2 * (p - 1) * t] * p
    assert peak_in_flight(zbv) == [2 * p] * p and peak_in_flight(zbh1) == [p] * p


def test_zbv_layout_paths_and_deps():
    p, m = 4, 8
    s = build_schedule("zbv", p, m)
    assert s.stage_rank == (0, 1, 2, 3, 3, 2, 1, 0)  # rank r holds stages r and 2p-1-r
    assert s.stage_part == tuple(range(8))  # 2p parts, each once
    assert all(s.paths[mb] == tuple(range(8)) for mb in range(m))  # down the ranks and back up
    assert s.deps(Action(4, "F", 0)) == [(3, "F", 0)]  # rank 3 hands part 3's output to itself
    assert s.deps(Action(7, "B", 0)) == [(7, "F", 0)]  # the loss on rank 0
    assert s.deps(Action(3, "B", 0)) == [(3, "F", 0), (4, "B", 0)]


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 11), (8, 16), (8, 20)])
@pytest.mark.parametrize("fb", [2, 2.5, 3])
def test_bubble_dualpipev(p, m, fb):
    """DualPipeV is DualPipe's schedule for 2p stages folded onto p ranks: the DualPipe formula
    with 2p stages, (2p/2 - 1)(F&B + B - 3W) = (p-1)(F&B + B - 3W) in chunk times, F = B_in =
    W = 1 and B = 2 the full backward. With F&B = F + B every rank idles it; with a gain from
    overlapping, the tip (rank p-1, whose first pair is not overlapped) still does."""
    s = build_schedule("dualpipev", p, m)
    idle = idle_per_rank(s, {"F": 1, "B": 1, "W": 1, "F&B": fb})
    formula = (p - 1) * (fb + 2 - 3 * 1)
    assert max(idle) == pytest.approx(formula) == idle[p - 1]
    if fb == 3:
        assert idle == [pytest.approx(formula)] * p


@pytest.mark.parametrize("durations", [{"F": 1, "B": 2, "W": 1, "F&B": 4}, {"F": 1, "B": 1, "W": 2, "F&B": 3.2},
                                       {"F": 1.5, "B": 0.7, "W": 0.3}])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 11), (8, 16)])
def test_dualpipev_idles_as_the_first_half_of_dualpipe_on_twice_the_ranks(p, m, durations):
    """DualPipeV is DualPipe cut in half: rank r runs the order of DualPipe's rank r on 2p
    ranks and 2m microbatches, its second direction folded onto the V's way back, so it idles
    as that rank does whatever the times (where the closed form above needs equal ones)."""
    v, d = build_schedule("dualpipev", p, m), build_schedule("dualpipe", 2 * p, 2 * m)
    assert idle_per_rank(v, durations) == pytest.approx(idle_per_rank(d, durations)[:p], abs=1e-9)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 20)])
def test_peak_in_flight_dualpipev(p, m):
    """Before its first backward rank r runs (p-r-1)*2 + (r+1) forwards of its first arm and
    r+1 of its second, 2p chunks; step 3 frees one for each it adds, and an F&B chunk holds
    both of its own: 2p + 1 chunks of 1/(2p) of the model, DualPipe's p+1 (DeepSeek-V3,
    Table 2) for 2p stages, on half the ranks."""
    assert peak_in_flight(build_schedule("dualpipev", p, m)) == [2 * p + 1] * p


def test_dualpipev_layout_and_the_reference_steps():
    """Rank r holds stages r and 2p-1-r, each part once (ZB-V's V); every microbatch walks
    all 2p; the step counts match the reference DualPipeV."""
    p, m = 8, 20
    s = build_schedule("dualpipev", p, m)
    assert s.stage_rank == tuple(range(p)) + tuple(reversed(range(p)))
    assert s.stage_part == tuple(range(2 * p)) and s.n_parts == 2 * p
    assert all(s.paths[mb] == tuple(range(2 * p)) for mb in range(m))
    assert s.deps(Action(p, "F", 0)) == [(p - 1, "F", 0)]  # the tip hands over to itself
    for r in range(p):
        acts = s.actions[r]
        # step 1's (p-r-1)*2 forwards of the first arm, then step 2 alternates, first arm first
        first_second = next(i for i, a in enumerate(acts) if a.stage != r)
        assert first_second == (p - r - 1) * 2 + 1
        assert [a.stage for a in acts[first_second - 1:first_second + 2 * r + 1]] == [r, 2 * p - 1 - r] * (r + 1)
        # overlapped chunks: 2 per step-4 iteration (one fewer on the tip) + 1 per step 5
        step4, step5 = m - 2 * p + r + 1, p - r - 1
        assert len(s.fb_pairs[r]) == 2 * step4 - (r == p - 1) + step5
    with pytest.raises(ValueError, match=r"at least 2p.*m=7, p=4"):
        build_schedule("dualpipev", 4, 7)
    with pytest.raises(ValueError, match=r"p >= 2.*p=1"):
        build_schedule("dualpipev", 1, 4)


def test_dualpipe_beats_1f1b_and_zb_h1_in_unit_time():
    p, m = 8, 20
    step = {n: timeline(build_schedule(n, p, m)).makespan for n in ("zb-h1", "dualpipe")}
    assert step["dualpipe"] == 3 * m + (p / 2 - 1) * 2 < step["zb-h1"] == 3 * m + p - 1


# --- memory: activations held per rank ------------------------------------------------------------

@pytest.mark.parametrize("p,m", [(1, 1), (2, 5), (4, 3), (4, 8), (8, 16)])
def test_peak_in_flight(p, m):
    assert peak_in_flight(build_schedule("1f1b", p, m)) == [min(p - r, m) for r in range(p)]
    assert peak_in_flight(build_schedule("gpipe", p, m)) == [m] * p
    # ZB-H1: rank r holds p-r like 1F1B plus the r W's it delays, so p everywhere (1F1B's peak)
    assert peak_in_flight(build_schedule("zb-h1", p, m)) == [min(p, m)] * p


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 4, 2), (4, 12, 3), (8, 16, 4)])
def test_peak_in_flight_interleaved(p, m, v):
    """Megatron: warm-up forwards plus the one in flight in 1F1B, in chunk activations (1/v of a stage)."""
    s = build_schedule("interleaved", p, m, v=v)
    expected = [m * v if m == p else min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) for r in range(p)]
    assert peak_in_flight(s) == expected


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 20)])
def test_peak_in_flight_dualpipe(p, m):
    """DeepSeek-V3 Table 2: activations of p+1 microbatches (an F&B chunk holds both of its own)."""
    assert peak_in_flight(build_schedule("dualpipe", p, m)) == [p + 1] * p


# --- structure: stages on ranks, paths, dependencies ------------------------------------------------

def test_interleaved_stage_layout_and_deps():
    s = build_schedule("interleaved", 4, 8, v=2)
    assert s.stage_rank == (0, 1, 2, 3, 0, 1, 2, 3) and s.stage_part == tuple(range(8))
    assert s.stages_of(1) == (1, 5)
    assert s.paths[3] == tuple(range(8))
    assert s.deps(Action(4, "F", 0)) == [(3, "F", 0)]  # rank 3 -> rank 0, next chunk
    assert s.deps(Action(3, "B", 0)) == [(3, "F", 0), (4, "B", 0)]
    assert s.deps(Action(7, "B", 2)) == [(7, "F", 2)]  # last stage: the loss is part of its F
    assert s.next_stage(3, 0) == 4 and s.prev_stage(0, 0) is None


def test_dualpipe_layout_paths_and_deps():
    p, m = 4, 8
    s = build_schedule("dualpipe", p, m)
    assert s.stage_rank == (0, 1, 2, 3, 3, 2, 1, 0)  # rank r holds stages r and 2p-1-r
    assert s.stage_part == (0, 1, 2, 3, 0, 1, 2, 3)  # rank r computes parts r and p-1-r
    assert all(s.paths[mb] == (0, 1, 2, 3) for mb in range(m // 2))
    assert all(s.paths[mb] == (4, 5, 6, 7) for mb in range(m // 2, m))  # ranks 3 -> 0
    assert s.deps(Action(5, "F", 4)) == [(4, "F", 4)]
    assert s.deps(Action(4, "B", 4)) == [(4, "F", 4), (5, "B", 4)]
    assert s.deps(Action(4, "W", 4)) == [(4, "B", 4)]
    assert s.overlapped_with(0)[Action(7, "B", 5)] == Action(0, "F", 3)


def test_dualpipe_follows_the_reference_steps():
    """Rank r and rank p-1-r mirror each other, and the step counts match the reference code."""
    p, m = 8, 20
    s = build_schedule("dualpipe", p, m)

    def mirror(a: Action) -> Action:
        return Action((a.stage + p) % (2 * p), a.kind, (a.mb + m // 2) % m)

    for r in range(p):
        assert [mirror(a) for a in s.actions[r]] == list(s.actions[p - 1 - r])
        h = min(r, p - 1 - r)
        # steps 1-2: (p/2-h-1)*2 + h+1 forwards of the near-side direction before the first far-side one
        acts = s.actions[r]
        first_far = next(i for i, a in enumerate(acts) if a.stage != acts[0].stage)
        assert first_far == (p // 2 - h - 1) * 2 + 1
        # overlapped chunks: 2 per step-4 iteration (one fewer on the middle ranks) + 1 per step 5
        step4, step5 = m // 2 - p + h + 1, p // 2 - h - 1
        assert len(s.fb_pairs[r]) == 2 * step4 - (h == p // 2 - 1) + step5
    with pytest.raises(ValueError, match=r"even .* got p=3"):
        build_schedule("dualpipe", 3, 12)
    with pytest.raises(ValueError, match=r"at least 2p.*m=6, p=4"):
        build_schedule("dualpipe", 4, 6)
    with pytest.raises(ValueError, match=r"even and at least 2p.*m=9, p=4"):
        build_schedule("dualpipe", 4, 9)


def test_interleaved_needs_m_multiple_of_p():
    with pytest.raises(ValueError, match=r"m=6 microbatches in groups of 4 leave a last group of 2, fewer than p=4"):
        build_schedule("interleaved", 4, 6, v=2)
    with pytest.raises(ValueError, match=r"at least as many microbatches as pipeline ranks; got m=3, p=4"):
        build_schedule("interleaved", 4, 3, v=2)
    with pytest.raises(ValueError, match="v >= 2"):
        build_schedule("interleaved", 4, 8, v=1)


def test_interleaved_groups_are_megatrons_schedule_table():
    """Megatron-LM's ``get_schedule_table``: microbatches in groups of g, each group through
    every chunk; the examples of its docstrings (g=2, m=4 and g=3, m=5, v=2)."""
    assert interleaved_table(2, 4, 2, 2) == list(zip([0, 1, 0, 1, 2, 3, 2, 3], [0, 0, 1, 1, 0, 0, 1, 1]))
    assert interleaved_table(2, 5, 2, 3) == list(zip([0, 1, 2, 0, 1, 2, 3, 4, 3, 4], [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]))
    # groups of p (the default) are the closed form the schedule used before groups could be set
    for p, m, v in [(4, 8, 2), (3, 9, 3), (2, 6, 4), (8, 16, 2)]:
        assert interleaved_table(p, m, v) == [((k // (p * v)) * p + k % p, (k % (p * v)) // p) for k in range(m * v)]
    # the warm-up counts the group: (p - r - 1) * 2 + (v - 1) * g forwards before the first B
    p, m, v, g = 4, 10, 2, 5
    s = build_schedule("interleaved", p, m, v=v, group=g)
    for r, acts in enumerate(s.actions):
        assert next(i for i, a in enumerate(acts) if a.kind == "B") == (p - r - 1) * 2 + (v - 1) * g + 1


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_interleaved_groups_run_where_their_last_group_holds_p(p):
    """Every group from p to m whose last group is whole or holds at least p gives an order
    that runs (built, dependencies checked: no rank waits on itself); one that leaves fewer than
    p is refused, as Megatron-LM refuses it."""
    for v in (2, 3):
        for m in range(p, 3 * p + 2):
            for g in range(p, m + 1):
                if m % g == 0 or m % g >= p:
                    s = build_schedule("interleaved", p, m, v=v, group=g)
                    assert sorted((a.stage, a.mb) for acts in s.actions for a in acts if a.kind == "F") == sorted(
                        (st, mb) for st in range(p * v) for mb in range(m))
                else:
                    with pytest.raises(ValueError, match=f"last group of {m % g}, fewer than p={p}"):
                        build_schedule("interleaved", p, m, v=v, group=g)
    with pytest.raises(ValueError, match=f"from p={p} to m={2 * p}"):
        build_schedule("interleaved", p, 2 * p, v=2, group=p - 1)


def test_a_short_last_group_can_deadlock(monkeypatch):
    """Why the rule holds: p=4, m=5, v=3 in groups of 4 leaves a last group of 1, and its order,
    built without the rule, deadlocks (rank 0's F of microbatch 4 on its last chunk waits on
    rank 3, which waits on rank 0's first B); p=4, m=6, v=2 only leaves ranks idle."""
    from clustersim.schedule import classic

    monkeypatch.setattr(classic, "interleaved_group_error", lambda p, m, group: None)
    with pytest.raises(ValueError, match="schedule deadlocks"):
        build_schedule("interleaved", 4, 5, v=3, group=4)
    build_schedule("interleaved", 4, 6, v=2, group=4)


def test_unit_time_grid_with_durations():
    g = unit_time_grid(build_schedule("1f1b", 2, 3), {"F": 1, "B": 2})
    rows = [" ".join(str(a) if a else "." for a in row) for row in g]
    assert rows == ["0F0 0F1 . . 0B0 0B0 0F2 0B1 0B1 . 0B2 0B2",
                    ". 1F0 1B0 1B0 1F1 1B1 1B1 1F2 1B2 1B2 . ."]
    with pytest.raises(ValueError, match="F&B"):
        unit_time_grid(build_schedule("dualpipe", 2, 4), {"F&B": 2})


def test_old_api_still_works():
    assert set(SCHEDULES) >= {"gpipe", "1f1b"}
    s = build_schedule("1f1b", 3, 4)
    assert isinstance(s, PipelineSchedule) and len(s) == 3 and s[1][0] == Action(1, "F", 0)
    assert unit_time_grid([list(r) for r in s]) == unit_time_grid(s)  # plain lists still accepted
    assert format_grid([list(r) for r in s]) == format_grid(s)
    assert action_deps(Action(1, "B", 2), last_stage=2) == [(1, "F", 2), (2, "B", 2)]
    assert action_deps(Action(0, "F", 2), last_stage=2) == []
    assert all(action_deps(a, 2) == s.deps(a) for acts in s for a in acts)


# --- custom schedules -------------------------------------------------------------------------------

def test_custom_text_csv_and_torch_tokens():
    text = """
        # 2 ranks, 2 microbatches, 1F1B with a split backward
        0F0 0F1 .   0I0 0W0 0B1
        .   1F0 1I0 1W0 1F1 1I1 1W1
    """
    s = build_schedule("custom", 2, 2, text=text)
    assert s.split_backward  # torch's I is our B; a plain B with no W of its own is a full backward: B then W
    assert [str(a) for a in s[0]] == ["0F0", "0F1", "0B0", "0W0", "0B1", "0W1"]
    csv = "0F0,0F1,,,0B0,0B1\n,1F0,1B0,1F1,1B1,"  # no W anywhere: B is the full backward
    c = build_schedule("custom", 2, 2, text=csv)
    assert not c.split_backward and c == build_schedule("1f1b", 2, 2)
    # torch communication tokens are skipped; the lowering derives communication itself
    comm = "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1"
    assert build_schedule("custom", 2, 2, text=comm) == c
    # a part mapping of the caller's: two stages on one rank computing parts 0 and 1 (a V shape)
    v = build_schedule("custom", 1, 1, text="0F0 1F0 1B0 0B0")
    assert v.stage_rank == (0, 0) and v.paths[0] == (0, 1) and v.deps(Action(1, "F", 0)) == [(0, "F", 0)]


BAD_CUSTOM = [
    # (what, text, words the message must contain)
    ("unknown token", "0F0 0X0 0B0", ["rank 0", "'0X0'", "not an action"]),
    ("duplicate", "0F0 0B0 0F1 0B1\n1F0 1B0 1F0 1B1 1F1", ["rank 1", "1F0", "appears twice"]),
    ("backward before forward", "0F0 0F1 0B0 0B1\n1B0 1F0 1F1 1B1", ["rank 1", "1B0", "needs 1F0 before it"]),
    ("weight before backward", "0F0 0W0 0B0", ["rank 0", "0W0", "needs 0B0 before it"]),
    ("missing backward", "0F0 0F1 0B0", ["rank 0", "0F1", "no backward B for microbatch 1"]),
    ("missing W", "0F0 0B0 0W0 0F1 0I1", ["rank 0", "'0I1'", "no 0W1"]),
    ("I without any W", "0F0 0I0", ["rank 0", "'0I0'", "no W"]),
    ("stage on two rows", "0F0 0B0\n0F1 0B1", ["stage 0", "rank 0 (token 0F0) and on rank 1 (token 0F1)"]),
    ("microbatch skips a stage", "0F0 0F1 0B0 0B1\n1F0 1B0", ["microbatch 1", "never on part 1", "rank 1"]),
    ("deadlock", "0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0",
     ["deadlock", "rank 0 waits at 0B0 for 1B0", "rank 1 waits at 1F1 for 0F1"]),
    ("wrong row label", "rank 0 | 0F0 0B0\nrank 2 | 1F0 1B0", ["rank 2", "row 1"]),
    ("overlap mark on a forward", "0F0 &0F1 0B0 0B1", ["'&0F1'", "only a backward"]),
    ("backward overlapping its own forward", "0F0 &0B0", ["rank 0", "0B0 cannot overlap 0F0"]),
    ("overlapped I right before its W", "0F0 0F1 &0I0 0W0 0B1 0W1", ["rank 0", "&0I0", "write &0B0"]),
    # numbers no array may be sized by (they crashed with an overflow or a 7 TiB allocation)
    ("huge microbatch", "0F0 0B0 0F99999999999999999999 0B1", ["rank 0, cell 2", "microbatch 99999999999999999999",
                                                              "4 actions"]),
    ("huge stage", "0F0 0B0\n1000000000000F0 1B0", ["rank 1, cell 0", "stage 1000000000000"]),
    ("full-width digit", "\uff10F0 0B0", ["rank 0, cell 0", "is not an action"]),  # (\d took it as 0)
]


@pytest.mark.parametrize("what,text,words", BAD_CUSTOM, ids=[b[0] for b in BAD_CUSTOM])
def test_custom_errors_name_rank_and_token(what, text, words):
    with pytest.raises(ScheduleError) as err:
        build_schedule("custom", None, None, text=text)
    for w in words:
        assert w in str(err.value), (what, str(err.value))


@pytest.mark.parametrize("name,p,m,kw", [("gpipe", 3, 5, {}), ("1f1b", 4, 9, {}), ("1f1b", 8, 3, {}),
                                         ("interleaved", 4, 8, {"v": 2}), ("zb-h1", 4, 6, {}),
                                         ("dualpipe", 4, 10, {})])
def test_the_array_check_passes_sound_schedules(name, p, m, kw):
    """The rows' structure is judged on arrays first; a sound schedule must pass there (the
    action-by-action walk, which names faults, would pass it too, only slower)."""
    from clustersim.schedule.core import _action_arrays, _rows_sound

    s = build_schedule(name, p, m, **kw)
    assert _rows_sound(_action_arrays(s.actions), s.split_backward)


@pytest.mark.parametrize("what,rows,split", [
    ("an action twice", [["0F0", "0B0", "0F0", "0B0"]], False),
    ("B before its F", [["0B0", "0F0"]], False),
    ("a W before its B", [["0F0", "0W0", "0B0"]], True),
    ("a B with no F", [["0F0", "0B0", "0B1"]], False),
    ("an F with no B", [["0F0", "0F1", "0B0"]], False),
    ("a B with no W", [["0F0", "0B0", "0W0", "0F1", "0B1"]], True),
    ("a microbatch missing", [["0F0", "0B0", "0F2", "0B2"]], False),
    ("a stage's F with its B on another stage", [["0F0", "1B0"], ["1F0", "0B0"]], False),
])
def test_the_array_check_refuses_faults(what, rows, split):
    """Each fault the walk names, the array check refuses (else the walk would never run)."""
    from clustersim.schedule.core import _action_arrays, _rows_sound

    parsed = [[Action(int(t[0]), t[1], int(t[2:])) for t in row] for row in rows]
    assert not _rows_sound(_action_arrays(parsed), split), what


def test_custom_shape_must_match_the_plan():
    with pytest.raises(ValueError, match="2 rows .* pp=4"):
        build_schedule("custom", 4, 2, text="0F0 0B0 0F1 0B1\n1F0 1B0 1F1 1B1")
    with pytest.raises(ValueError, match="2 microbatches but m=3"):
        build_schedule("custom", 2, 3, text="0F0 0B0 0F1 0B1\n1F0 1B0 1F1 1B1")
    with pytest.raises(ValueError, match="text="):
        build_schedule("custom", 2, 2)


def test_deadlocking_order_is_refused():
    # stage 1 wants microbatch 1 before 0, stage 0 sends 0 first and then waits on 1B0
    bad = [[Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
           [Action(1, "F", 1), Action(1, "B", 1), Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        unit_time_grid(bad)


def test_unknown_schedule():
    with pytest.raises(KeyError, match="unknown schedule"):
        build_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="unknown option"):
        build_schedule("1f1b", 2, 2, v=2)


def test_schedule_errors_are_config_errors():
    """The command line prints ConfigError as one line; schedule errors are both kinds."""
    from clustersim.errors import ConfigError

    with pytest.raises(ConfigError):
        build_schedule("dualpipe", 3, 6)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_finishes_with_every_slot_accounted(name):
    opts = {"v": 2} if name == "interleaved" else {}
    for p, m in itertools.product([2, 4], [8, 12]):
        s = build_schedule(name, p, m, **opts)
        grid = unit_time_grid(s)
        busy = [sum(a is not None for a in row) for row in grid]
        assert busy == [len(acts) for acts in s.actions]
        assert [len(row) - b for row, b in zip(grid, busy)] == idle_per_rank(s)


@pytest.mark.parametrize("name,p,m,opts", CASES, ids=CASE_IDS)
def test_placement_plan_waits_for_each_actions_deps(name, p, m, opts):
    """The placement's plan (one action per unit, its dependencies inline) waits for exactly
    what ``PipelineSchedule.deps`` says each action needs; overlapped chunks for what their
    actions need from outside the chunk. A full backward written B then W holds its B's output
    until its W ends: that B is marked held, that W releasing and waiting for nothing (its B
    runs right before it on the rank)."""
    from clustersim.schedule.core import (KINDS, _HELD_B, _RELEASING_W, _key_of, _plan, fused_weight_passes,
                                          issue_units)

    s = build_schedule(name, p, m, **opts)
    rows, chunks = _plan(s)
    key = lambda code: _key_of(code, s.n_microbatches)  # noqa: E731
    kind_of = {**dict(enumerate(KINDS)), _HELD_B: "B", _RELEASING_W: "W"}
    for r, row in enumerate(rows):
        units = issue_units(s, r)
        full = fused_weight_passes(s, r) if s.split_backward else set()
        assert len(row) == len(units)
        for (code, d1, d2, kind), u in zip(row, units):
            if code >= 0:  # one action
                keys, deps, kinds = (key(code),), [key(d) for d in (d1, d2) if d >= 0], (kind,)
            else:  # an overlapped chunk
                codes, kinds, waits = chunks[-1 - code]
                keys, deps = tuple(map(key, codes)), list(map(key, waits))
            assert keys == tuple(a.key for a in u)
            assert tuple(kind_of[k] for k in kinds) == tuple(a.kind for a in u)
            for a, k in zip(u, kinds):
                assert (k in (_HELD_B, _RELEASING_W)) == (a.kind != "F" and (a.stage, a.mb) in full)
            if code >= 0 and kind == _RELEASING_W:
                assert deps == []
            else:
                assert deps == [d for a in u for d in s.deps(a) if d not in keys]


@pytest.mark.parametrize("name,p,m,opts", [*CASES, (CUSTOM, 2, 2, {
    "text": "0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1", "stage_part": (1, 0)})], ids=[*CASE_IDS, "custom-parts-reversed"])
def test_structure_on_arrays_is_the_walks(name, p, m, opts):
    """Stage ranks, paths and path neighbours are read off the actions' arrays; the walks
    over the rows (which name faults) give the same, and the neighbours follow the paths
    (also where stages do not compute parts in their order: the custom case's paths are
    stage 1, then 0)."""
    from clustersim.schedule.core import _paths, _paths_on_arrays, _stage_ranks

    s = build_schedule(name, p, m, **opts)
    assert _stage_ranks(s.actions, s._flat) == _stage_ranks(s.actions, None) == s.stage_rank
    assert _paths_on_arrays(s._flat, s.stage_part) == _paths(s.actions, s.stage_part, s.stage_rank) == s.paths
    for mb, path in enumerate(s.paths):
        assert [s.prev_stage(k, mb) for k in path] == [None, *path[:-1]]
        assert [s.next_stage(k, mb) for k in path] == [*path[1:], None]
    assert len(s._next) == len(s._prev) == sum(len(path) - 1 for path in s.paths)


def test_timeline_reads_as_a_mapping_of_the_actions():
    """``Timeline.start``, ``end`` and ``release`` map exactly the schedule's action keys: no
    other key (another kind, microbatch or stage, or not a key at all) is in them."""
    s = build_schedule("zb-h1", 3, 4)
    tl = timeline(s)
    keys = sorted(a.key for acts in s.actions for a in acts)
    for times in (tl.start, tl.end, tl.release):
        assert sorted(times) == keys and len(times) == len(keys)
        assert dict(times) == {k: times[k] for k in keys}
    assert tl.start[(0, "F", 0)] == 0.0 and tl.end[(0, "F", 0)] == 1.0
    for missing in [(0, "X", 0), (0, "F", 4), (3, "F", 0), (-1, "F", 0), (0, "F", -1), ("0", "F", 0), (0, "F"), None]:
        assert missing not in tl.start and tl.release.get(missing) is None
    assert (0, "W", 0) not in timeline(build_schedule("1f1b", 3, 4)).start  # no W actions there


def test_interleaved_refuses_a_single_rank():
    """With p=1 there is nothing to interleave over: one rank runs its chunks as one stage
    (Megatron-LM requires pp > 1 for its interleaved schedule)."""
    with pytest.raises(ScheduleError, match="needs p >= 2 pipeline ranks"):
        build_schedule("interleaved", 1, 4, v=2)
    assert build_schedule("interleaved", 2, 4, v=2)


def test_v_shapes_refuse_a_single_rank():
    """ZB-V and DualPipeV place two parts a rank as a V over the ranks: over one rank it is one
    stage, which a scenario's check refuses and so does the schedule itself (``clustersim
    schedule --pp 1 --schedule zbv`` printed a grid)."""
    for name in ("zbv", "dualpipev"):
        with pytest.raises(ScheduleError, match="needs p >= 2 pipeline ranks for its V"):
            build_schedule(name, 1, 4)
        assert build_schedule(name, 2, 4)


def test_split_weight_passes_hold_what_w_reads_from_b_to_w():
    """ZB-H1 and ZB-V split every backward, even where a W runs right after its B (rank 0);
    DualPipe the backwards it queues for its zero-bubble steps (the reference's ``enable_zb``:
    step 3, the second half of step 6, step 7), not its full ones (written B then W, each
    overlapped chunk's among them); a custom schedule every W not written right after its B;
    1F1B none."""
    from clustersim.schedule.core import split_weight_passes
    p, m = 4, 8
    for name in ("zb-h1", "zbv"):
        s = build_schedule(name, p, m)
        assert all(split_weight_passes(s, r) == {(a.stage, a.mb) for a in s.actions[r] if a.kind == "W"}
                   for r in range(p))
    dp = build_schedule("dualpipe", p, m)
    for r in range(p):
        acts, split = dp.actions[r], split_weight_passes(dp, r)
        overlapped = {(b.stage, b.mb) for _, b in dp.fb_pairs[r]}
        assert split and not split & overlapped
        for stage, mb in split:  # the B before a split W is never an overlapped chunk's
            assert (stage, mb) not in overlapped
        for i, a in enumerate(acts):  # a W not right after its B is always split
            if a.kind == "W" and acts[i - 1] != Action(a.stage, "B", a.mb):
                assert (a.stage, a.mb) in split
    # read back from its grid, the same DualPipe: a split B right before its W is written I
    parsed = parse_grid(format_grid(dp), stage_part=dp.stage_part)
    assert parsed == dp and all(split_weight_passes(parsed, r) == split_weight_passes(dp, r) for r in range(p))
    # a hand-written file: a W right after its B is a full backward's, after an I a split one's
    hand = parse_grid("0F0 0F1 0B0 0W0 0I1 0W1")
    assert split_weight_passes(hand, 0) == {(0, 1)}
    assert not any(split_weight_passes(build_schedule("1f1b", p, m), r) for r in range(p))
    from clustersim.schedule.core import make_schedule
    rows = build_schedule("zb-h1", 2, 2).actions  # rank 1: 1F0 1B0 1F1 1B1 1W0 1W1
    assert make_schedule("x", rows, fused_w=[frozenset({(0, 0), (0, 1)}), frozenset()])
    with pytest.raises(ScheduleError, match="rank 1: 1W0 is marked as a full backward's"):
        make_schedule("x", rows, fused_w=[frozenset(), frozenset({(1, 0)})])


@pytest.mark.parametrize("name,p,m", [("dualpipe", 4, 16), ("dualpipe", 8, 20), ("dualpipev", 4, 8),
                                      ("dualpipev", 3, 7)])
def test_a_full_backward_releases_its_gradient_when_its_w_ends(name, p, m):
    """DeepSeek's reference runs a backward it does not split (``_backward_chunk(enable_zb=False)``)
    whole, weight gradients inline, and only then sends its gradient: the stage before (on
    another rank, or on the same one at a V's turn) starts that microbatch's backward no earlier
    than the W written after the B ends, and with W shorter than B the step is longer than
    where B alone released it (DualPipe p4 m16 at F 1, B 2, W 0.5: 59.5 against 59.0, as an
    independent transcription of the reference's eight steps gives)."""
    from clustersim.schedule.core import fused_weight_passes

    s = build_schedule(name, p, m)
    tl = timeline(s, {"F": 1.0, "B": 2.0, "W": 0.5})
    held = 0
    for r in range(s.ranks):
        for stage, mb in fused_weight_passes(s, r):
            w_end = tl.end[(stage, "W", mb)]
            assert tl.release[(stage, "B", mb)] == w_end
            before = s.prev_stage(stage, mb)
            if before is not None:
                assert tl.start[(before, "B", mb)] >= w_end
                held += 1
    assert held  # not vacuous
    if (name, p, m) == ("dualpipe", 4, 16):
        assert tl.makespan == 59.5
