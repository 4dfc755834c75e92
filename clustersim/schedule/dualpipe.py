"""DualPipe: bidirectional pipeline with overlapped forward/backward chunks (DeepSeek-V3).

DeepSeek-V3 technical report (arXiv:2412.19437), Sec 3.2.1 and Fig. 5. The model is cut into
p parts and every rank holds two of them: in direction 0 rank r computes part r (microbatches
enter at rank 0), in direction 1 rank r computes part p-1-r (they enter at rank p-1). The
first half of the microbatches goes one way, the second half the other way, so both ends of
the pipeline start working at once. In the steady state each rank runs a forward chunk of
one direction overlapped with a full backward chunk of the other (F&B), hiding the MoE
all-to-all of one behind the compute of the other.

Virtual stages: stage r (direction 0) and stage 2p-1-r (direction 1) live on rank r;
stage k < p computes part k, stage p + j computes part j. Direction-0 microbatches are
0..m/2-1 and walk stages 0..p-1; direction-1 microbatches are m/2..m-1 and walk stages
p..2p-1, i.e. ranks p-1 -> 0. p=4, m=8, unit time (F = B = W = 1, an F&B chunk = F + B + W,
drawn ``F &B W``)::

    rank 0  | 0F0  0F1  0F2  7F4  7B4  7W4  7F5  0F3  &7B5 7W5  .    7F6  &0B0 0W0  7B6 ...
    rank 3  | 4F4  4F5  4F6  3F0  3B0  3W0  3F1  4F7  &3B1 3W1  .    3F2  &4B4 4W4  3B2 ...

Order per rank: the eight steps of the public reference implementation
(github.com/deepseek-ai/DualPipe, ``DualPipe.step``); half_rank h = min(r, p-1-r), phase 0 is
the direction entering on the rank's own side::

    1  nF0       (p/2 - h - 1) * 2 forwards of phase 0
    2  nF0F1     h + 1 pairs F(phase 0), F(phase 1)
    3  nB1W1F1   p/2 - h - 1 x [B(phase 1) W F(phase 1)]      (B split: W taken from the queue)
    4  nF0B1F1B0 m/2 - p + h + 1 x [F0&B1, F1&B0]             (overlapped chunks, full backward)
    5  nB1F1B0   p/2 - h - 1 x [B(phase 1), F1&B0]
    6  nB1B0     h + 1 x [B1, B0]; the second half of them split (W queued)
    7  nWB0      p/2 - h - 1 x [W, B(phase 0) split]
    8  nW        h + 1 W's: drain the queue (FIFO)

Modelling choices (the reference implementation's compute order is kept exactly):
- A backward that the reference runs without zero-bubble splitting is a full backward: we
  write it B immediately followed by its W, so every (stage, mb) has one B and one W.
- Communication is free and a chunk's outputs are released when the chunk ends; the
  reference's choice of *when* to post a send (e.g. step 2 sends F0's output after F1) is
  left to the lowering, which prices communication.
- On the two middle ranks the first step-4 pair is not overlapped, as in the reference.

Bubble: (p/2-1)(F&B + B - 3W) per the report's Table 2, with B the full backward; parameters
held twice; activations of p+1 microbatches per rank. The public code asserts p even, m even
and m >= 2p (each direction gets at least p microbatches); we enforce the same.
"""

from __future__ import annotations

from collections import deque

from .core import Action, PipelineSchedule, ScheduleError, make_schedule


def dualpipe_stage_part(p: int) -> tuple[int, ...]:
    """Part computed by each virtual stage: 0..p-1 for direction 0, again 0..p-1 for direction 1."""
    return tuple(range(p)) + tuple(range(p))


def dualpipe(p: int, m: int) -> PipelineSchedule:
    if p < 2 or p % 2:
        raise ScheduleError(f"dualpipe: the number of pipeline ranks must be even (two directions meet in "
                            f"the middle); got p={p}", about="p")
    if m % 2 or m < 2 * p:
        raise ScheduleError(f"dualpipe: the number of microbatches must be even and at least 2p, half per "
                            f"direction with at least p each (as the reference DualPipe asserts); got m={m}, p={p}",
                            about="m")
    half = p // 2
    rows, pairs, fused = [], [], []
    for r in range(p):
        hr = min(r, p - 1 - r)
        second = r >= half
        middle = r in (half - 1, half)
        stage = (r, 2 * p - 1 - r)  # by direction
        first_mb = (0, m // 2)
        nf, nb = [0, 0], [0, 0]
        w_queue: deque[Action] = deque()
        acts: list[Action] = []
        full: set[tuple[int, int]] = set()  # (stage, mb) of its full backwards
        fb: list[tuple[Action, Action]] = []

        def fwd(phase: int) -> Action:
            d = phase ^ second
            a = Action(stage[d], "F", first_mb[d] + nf[d])
            nf[d] += 1
            acts.append(a)
            return a

        def bwd(phase: int, zb: bool) -> Action:
            d = phase ^ second
            a = Action(stage[d], "B", first_mb[d] + nb[d])
            nb[d] += 1
            acts.append(a)
            w = Action(a.stage, "W", a.mb)
            if zb:  # weight gradient deferred to a later W slot (FIFO, as WeightGradStore)
                w_queue.append(w)
            else:  # full backward: its weight part right after
                acts.append(w)
                full.add((a.stage, a.mb))
            return a

        def weight() -> None:
            acts.append(w_queue.popleft())

        def fwd_bwd(phase0: int, phase1: int) -> None:
            f = fwd(phase0)
            b = bwd(phase1, zb=False)
            fb.append((f, b))

        for _ in range((half - hr - 1) * 2):  # step 1
            fwd(0)
        for _ in range(hr + 1):  # step 2
            fwd(0)
            fwd(1)
        for _ in range(half - hr - 1):  # step 3
            bwd(1, zb=True)
            weight()
            fwd(1)
        for i in range(m // 2 - p + hr + 1):  # step 4
            if i == 0 and middle:  # the reference does not overlap this pair, to shrink the bubble
                fwd(0)
                bwd(1, zb=False)
            else:
                fwd_bwd(0, 1)
            fwd_bwd(1, 0)
        for _ in range(half - hr - 1):  # step 5
            bwd(1, zb=False)
            fwd_bwd(1, 0)
        zb = False
        for i in range(hr + 1):  # step 6
            if i == (hr + 1) // 2 and hr % 2 == 1:
                zb = True
            bwd(1, zb)
            if i == (hr + 1) // 2 and hr % 2 == 0:
                zb = True
            bwd(0, zb)
        for _ in range(half - hr - 1):  # step 7
            weight()
            bwd(0, zb=True)
        for _ in range(hr + 1):  # step 8
            weight()
        assert not w_queue and nf == [m // 2] * 2 and nb == [m // 2] * 2  # the step counts add up
        rows.append(acts)
        pairs.append(fb)
        fused.append(frozenset(full))
    return make_schedule("dualpipe", rows, stage_part=dualpipe_stage_part(p), fb_pairs=pairs, fused_w=fused)
