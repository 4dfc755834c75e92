"""ZB-H1: 1F1B with the backward split into B (input gradient) and W (weight gradient).

Qi et al. 2023, "Zero Bubble Pipeline Parallelism" (arXiv:2401.10241), Sec 3.1 / Fig. 3.
Only B lies on the critical path between stages; W can wait. ZB-H1 keeps 1F1B's warm-up and
its 1F1B steady state (F then B), but rank r holds back the W of its first r backwards and
runs them at the end, where 1F1B's cool-down leaves rank r idle. The last ranks get further
ahead in the steady state and the cool-down bubbles fill with W::

    p=4, m=8, unit time (F = B = W = 1)
    rank 0  | 0F0 0F1 0F2 0F3 .   .   .   0B0 0W0 0F4 0B1 0W1 0F5 ...
    rank 3  | .   .   .   3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 ...   ... 3W5 3W6 3W7

Every rank then holds at most p microbatches' activations (until their W), the same peak
as 1F1B's rank 0, and the bubble drops from (p-1)(F+B+W) to (p-1)(F+B-W) with B the input
gradient, i.e. (p-1)(F+B-2W) with B the full backward. The closed form assumes
T_F = T_B = T_W, as the paper's handcrafted schedules do.
"""

from __future__ import annotations

from .core import Action, PipelineSchedule, ScheduleError, make_schedule


def zb_h1(p: int, m: int) -> PipelineSchedule:
    """Rank r: min(p-r-1, m) warm-up F; then F B pairs, the i-th backward followed by the W
    of backward i-r once i >= r; the cool-down B's likewise; then the r withheld W's."""
    if p < 1 or m < 1:
        raise ScheduleError(f"zb-h1: need p >= 1 ranks and m >= 1 microbatches; got p={p}, m={m}",
                            about="p" if p < 1 else "m")
    rows = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [Action(r, "F", i) for i in range(warm)]
        n_w = 0
        for i in range(m):  # the i-th backward, preceded by a forward while forwards remain
            if warm + i < m:
                acts.append(Action(r, "F", warm + i))
            acts.append(Action(r, "B", i))
            if i >= r:  # W lags B by r: rank r's early W's wait for its cool-down bubble
                acts.append(Action(r, "W", n_w))
                n_w += 1
        acts += [Action(r, "W", i) for i in range(n_w, m)]
        rows.append(acts)
    return make_schedule("zb-h1", rows)


def zb_v(p: int, m: int) -> PipelineSchedule:
    """ZB-V: the model in 2p parts placed as a V, rank r holding parts r and 2p-1-r, the
    backward split into B and W (Qi et al. 2024, "Pipeline Parallelism with Controllable
    Memory", arXiv:2405.15362, Sec 4; PyTorch's ``ScheduleZBVZeroBubble``).

    A microbatch goes down the ranks on its first chunk (parts 0..p-1) and back up on its
    second (parts p..2p-1, the loss on rank 0), so rank p-1 hands part p-1's output to itself
    and rank 0 starts the backward. Per rank, with c0 = part r and c1 = part 2p-1-r::

        warm-up     2(p-r)-1 x F(c0);  r x [F(c1) F(c0)];  p-r x [F(c1) B(c1) W(c1)]
        steady      [F(c0) B(c0) W(c0) F(c1) B(c1) W(c1)] until every forward is issued
        cool-down   r x [B(c0) B(c1)] (their W's held back);  p-r x [B(c0) W(c0)]
        drain       the W(c1)'s held back, then the W(c0)'s

    p=2, m=4, unit time (F = B = W = 1)::

        rank 0  | 0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3 .
        rank 1  | .   1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3

    With T_F = T_B = T_W the steady state has no bubble, and a rank holds at most 2p chunks'
    activations of half a stage each: 1F1B's peak (p stages' worth on rank 0). The
    construction is written for m >= 2p-1 microbatches; with fewer, the actions of the
    missing ones are dropped (as PyTorch does).
    """
    if p < 1 or m < 1:
        raise ScheduleError(f"zbv: need p >= 1 ranks and m >= 1 microbatches; got p={p}, m={m}",
                            about="p" if p < 1 else "m")
    n = max(2 * p - 1, m)
    rows = []
    for r in range(p):
        stage = (r, 2 * p - 1 - r)
        issued = {(c, k): 0 for c in (0, 1) for k in "FBW"}
        acts: list[Action] = []

        def run(*steps: str) -> None:
            for step in steps:  # "F0": a forward of chunk 0, the chunk's next microbatch
                c, k = int(step[1]), step[0]
                acts.append(Action(stage[c], k, issued[(c, k)]))
                issued[(c, k)] += 1

        run(*["F0"] * (2 * (p - r) - 1))
        for _ in range(r):
            run("F1", "F0")
        for _ in range(p - r):
            run("F1", "B1", "W1")
        while issued[(1, "F")] < issued[(0, "F")] or issued[(0, "F")] < n:
            if issued[(0, "F")] < n:
                run("F0")
            run("B0", "W0", "F1", "B1", "W1")
        for _ in range(r):
            run("B0", "B1")
        for _ in range(p - r):
            run("B0", "W0")
        run(*["W1"] * (issued[(1, "B")] - issued[(1, "W")]), *["W0"] * (issued[(0, "B")] - issued[(0, "W")]))
        assert all(issued[(c, k)] == n for c in (0, 1) for k in "FBW")  # the phases add up
        rows.append([a for a in acts if a.mb < m])
    return make_schedule("zbv", rows)
