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
