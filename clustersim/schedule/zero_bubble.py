"""ZB-H1: 1F1B with the backward split into B (input gradient) and W (weight gradient).

Qi et al. 2023, "Zero Bubble Pipeline Parallelism" (arXiv:2401.10241), Sec 3.1 / Fig. 3.
Only B lies on the critical path between stages; W can wait. ZB-H1 keeps 1F1B's warm-up and
its 1F1B steady state (F then B), but rank r holds back the W of its first r backwards and
runs them at the end, where 1F1B's cool-down leaves rank r idle. The last ranks get further
ahead in the steady state and the cool-down bubbles fill with W::

    p=4, m=8, unit time (F = B = W = 1)
    rank 0  | 0F0 0F1 0F2 0F3 .   .   .   0I0 0W0 0F4 0I1 0W1 0F5 ...     (I: a split B, grid.py)
    rank 3  | .   .   .   3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 ...   ... 3W5 3W6 3W7

Every rank then holds at most p microbatches (rank r: p-r microbatches' activations M_B and
r held for their W, M_W each; where M_W < M_B rank 0's peak is 1F1B's, p M_B:
analysis/memory.py), and the bubble drops from (p-1)(F+B+W) to (p-1)(F+B-W) with B the input
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
    return make_schedule("zb-h1", rows, fused_w=[frozenset()] * p)  # every backward split


def zb_v(p: int, m: int) -> PipelineSchedule:
    """ZB-V: the model in 2p parts placed as a V, rank r holding parts r and 2p-1-r, the
    backward split into B and W (Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
    arXiv:2401.10241, Sec 6; PyTorch's ``ScheduleZBVZeroBubble``).

    A microbatch goes down the ranks on its first chunk (parts 0..p-1) and back up on its
    second (parts p..2p-1, the loss on rank 0), so rank p-1 hands part p-1's output to itself
    and rank 0 starts the backward. Per rank, with c0 = part r and c1 = part 2p-1-r::

        warm-up     2(p-r)-1 x F(c0);  r x [F(c1) F(c0)];  p-r x [F(c1) B(c1) W(c1)]
        steady      [F(c0) B(c0) W(c0) F(c1) B(c1) W(c1)] until every forward is issued
        cool-down   r x [B(c0) B(c1)] (their W's held back);  p-r x [B(c0) W(c0)]
        drain       the W(c1)'s held back, then the W(c0)'s

    p=2, m=4, unit time (F = B = W = 1)::

        rank 0  | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3 .
        rank 1  | .   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1B2 2B3 1B3 1W2 2W3 1W3

    With T_F = T_B = T_W = T per chunk and m >= 2p-1 the steady state has no bubble: rank r
    idles r T before its first action and (p-1-r) T after its last, (p-1) T, half of ZB-H1's
    (p-1) 2T on the same model; the paper's zero bubble also removes these ends, by moving the
    optimizer's synchronisation off the critical path (its post-validation, not modelled).
    A rank holds at most 2p chunks' activations, half a stage each: 1F1B's peak (p stages'
    worth on rank 0). The construction is written for n = max(m, 2p-1) microbatches; the
    actions of microbatches past m are dropped (as PyTorch does), and once every count has
    passed m nothing more is kept, so the rest is not built.
    """
    if p < 2 or m < 1:  # (a V over one rank is one stage: the scenario's check says the same)
        raise ScheduleError(f"zbv: needs p >= 2 pipeline ranks for its V and m >= 1 microbatches; got p={p}, m={m}",
                            about="p" if p < 2 else "m")
    n = max(2 * p - 1, m)
    rows = []
    for r in range(p):
        stage = (r, 2 * p - 1 - r)
        issued = {(c, k): 0 for c in (0, 1) for k in "FBW"}
        acts: list[Action] = []

        def run(*steps: str, times: int = 1) -> bool:
            """Issue ``steps`` ("F0": a forward of chunk 0, of its next microbatch) ``times``
            over; False once every count has passed m (what follows would all be dropped).
            Only the rounds that keep an action are walked; the others just count."""
            keys = [(int(step[1]), step[0]) for step in steps]
            kept = min(times, max(m - issued[key] for key in keys))
            for _ in range(kept):
                for c, k in keys:
                    if issued[(c, k)] < m:
                        acts.append(Action(stage[c], k, issued[(c, k)]))
                    issued[(c, k)] += 1
            for key in keys:
                issued[key] += times - max(kept, 0)
            return min(issued.values()) < m

        def phases() -> None:
            if not run("F0", times=2 * (p - r) - 1) or not run("F1", "F0", times=r) \
                    or not run("F1", "B1", "W1", times=p - r):
                return
            while issued[(1, "F")] < issued[(0, "F")] or issued[(0, "F")] < n:
                if issued[(0, "F")] < n and not run("F0"):
                    return
                if not run("B0", "W0", "F1", "B1", "W1"):
                    return
            if not run("B0", "B1", times=r) or not run("B0", "W0", times=p - r):
                return
            if run("W1", times=issued[(1, "B")] - issued[(1, "W")]) \
                    and run("W0", times=issued[(0, "B")] - issued[(0, "W")]):
                assert all(v == n for v in issued.values())  # the phases add up

        phases()
        rows.append(acts)
    return make_schedule("zbv", rows, fused_w=[frozenset()] * p)  # every backward split
