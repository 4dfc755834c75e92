"""DualPipe and DualPipeV: pipelines with overlapped forward/backward chunks (DeepSeek-V3).

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
drawn ``F &B W``; ``I`` a split B whose W follows at once, grid.py)::

    rank 0  | 0F0  0F1  0F2  7F4  7I4  7W4  7F5  0F3  &7B5 7W5  .    7F6  &0B0 0W0  7B6 ...
    rank 3  | 4F4  4F5  4F6  3F0  3I0  3W0  3F1  4F7  &3B1 3W1  .    3F2  &4B4 4W4  3B2 ...

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


class _Order:
    """One rank's actions in the reference's order: forwards and backwards of its two
    phases, each its own stage and first microbatch; a split backward queues its W (FIFO,
    as the reference's WeightGradStore), a full one takes it at once; F&B pairs noted."""

    def __init__(self, stage: tuple[int, int], first_mb: tuple[int, int]):
        self.stage, self.first_mb = stage, first_mb
        self.nf, self.nb = [0, 0], [0, 0]
        self.w_queue: deque[Action] = deque()
        self.acts: list[Action] = []
        self.full: set[tuple[int, int]] = set()  # (stage, mb) of its full backwards
        self.fb: list[tuple[Action, Action]] = []

    def fwd(self, d: int) -> Action:
        a = Action(self.stage[d], "F", self.first_mb[d] + self.nf[d])
        self.nf[d] += 1
        self.acts.append(a)
        return a

    def bwd(self, d: int, zb: bool) -> Action:
        a = Action(self.stage[d], "B", self.first_mb[d] + self.nb[d])
        self.nb[d] += 1
        self.acts.append(a)
        w = Action(a.stage, "W", a.mb)
        if zb:  # weight gradient deferred to a later W slot
            self.w_queue.append(w)
        else:  # full backward: its weight part right after
            self.acts.append(w)
            self.full.add((a.stage, a.mb))
        return a

    def weight(self) -> None:
        self.acts.append(self.w_queue.popleft())

    def fwd_bwd(self, f: int, b: int) -> None:
        self.fb.append((self.fwd(f), self.bwd(b, zb=False)))


def _eight_steps(o: _Order, h: int, half: int, main: int, tip: bool, phase) -> None:
    """The eight steps both references share, for a rank whose distance from its end of the
    pipeline is ``h`` of ``half`` (DualPipe: half_rank of p/2; DualPipeV: r of p), with
    ``main`` step-4 pairs; ``tip``: its first step-4 pair is not overlapped (the reference
    shrinks the bubble so); ``phase`` maps the reference's phase 0/1 to the rank's stages."""
    f, b = (lambda ph: o.fwd(phase(ph))), (lambda ph, zb: o.bwd(phase(ph), zb))
    for _ in range((half - h - 1) * 2):  # step 1
        f(0)
    for _ in range(h + 1):  # step 2
        f(0)
        f(1)
    for _ in range(half - h - 1):  # step 3
        b(1, True)
        o.weight()
        f(1)
    for i in range(main):  # step 4
        if i == 0 and tip:
            f(0)
            b(1, False)
        else:
            o.fwd_bwd(phase(0), phase(1))
        o.fwd_bwd(phase(1), phase(0))
    for _ in range(half - h - 1):  # step 5
        b(1, False)
        o.fwd_bwd(phase(1), phase(0))
    zb = False
    for i in range(h + 1):  # step 6
        if i == (h + 1) // 2 and h % 2 == 1:
            zb = True
        b(1, zb)
        if i == (h + 1) // 2 and h % 2 == 0:
            zb = True
        b(0, zb)
    for _ in range(half - h - 1):  # step 7
        o.weight()
        b(0, True)
    for _ in range(h + 1):  # step 8
        o.weight()


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
        second = int(r >= half)
        o = _Order((r, 2 * p - 1 - r), (0, m // 2))  # by direction
        _eight_steps(o, hr, half, m // 2 - p + hr + 1, r in (half - 1, half), lambda ph: ph ^ second)
        assert not o.w_queue and o.nf == [m // 2] * 2 and o.nb == [m // 2] * 2  # the step counts add up
        rows.append(o.acts)
        pairs.append(o.fb)
        fused.append(frozenset(o.full))
    return make_schedule("dualpipe", rows, stage_part=dualpipe_stage_part(p), fb_pairs=pairs, fused_w=fused)


def dualpipev(p: int, m: int) -> PipelineSchedule:
    """DualPipeV: DualPipe cut in half, one V over p ranks (DeepSeek's ``DualPipeV``).

    The model is cut into 2p parts; rank r holds stage r (phase 0, down the ranks) and stage
    2p-1-r (phase 1, back up), where ZB-V places them, and every microbatch walks both: one
    direction, each part held once where DualPipe holds every part twice. Per rank the
    eight steps above with h = r out of p (the public reference, ``DualPipeV.step``)::

        1  nF0        (p - r - 1) * 2 forwards of phase 0
        2  nF0F1      r + 1 pairs F(phase 0), F(phase 1)
        3  nB1W1F1    p - r - 1 x [B(phase 1) W F(phase 1)]        (B split: W from the queue)
        4  nF0B1F1B0  m - 2p + r + 1 x [F0&B1, F1&B0]              (overlapped, full backward)
        5  nB1F1B0    p - r - 1 x [B(phase 1), F1&B0]
        6  nB1B0      r + 1 x [B1, B0]; the second half split (W queued)
        7  nWB0       p - r - 1 x [W, B(phase 0) split]
        8  nW         r + 1 W's: drain the queue (FIFO)

    The last rank holds the V's tip (stages p-1 and p); its first step-4 pair is not
    overlapped, as in the reference. It idles as DualPipe on 2p ranks and 2m microbatches does,
    (p-1)(F&B + B - 3W) in part times where T_F = T_B = T_W; parameters once (1F1B's); the
    reference asserts m >= 2p.
    """
    if p < 2:
        raise ScheduleError(f"dualpipev: needs p >= 2 pipeline ranks for its V; got p={p} (one rank would "
                            f"run both arms)", about="p")
    if m < 2 * p:
        raise ScheduleError(f"dualpipev: the number of microbatches must be at least 2p (as the reference "
                            f"DualPipeV asserts); got m={m}, p={p}", about="m")
    rows, pairs, fused = [], [], []
    for r in range(p):
        o = _Order((r, 2 * p - 1 - r), (0, 0))
        _eight_steps(o, r, p, m - 2 * p + r + 1, r == p - 1, lambda ph: ph)
        assert not o.w_queue and o.nf == [m, m] and o.nb == [m, m]  # the step counts add up
        rows.append(o.acts)
        pairs.append(o.fb)
        fused.append(frozenset(o.full))
    return make_schedule("dualpipev", rows, fb_pairs=pairs, fused_w=fused)
