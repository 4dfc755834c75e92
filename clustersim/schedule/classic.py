"""GPipe, 1F1B and Megatron's interleaved 1F1B: the schedules with a full backward B.

GPipe and 1F1B, p=4 ranks, m=8 microbatches, unit time (F = B = 1), rank r runs stage r::

    gpipe                                       1f1b
    rank 0 | 0F0 0F1 0F2 0F3 0F4 0F5 ...        rank 0 | 0F0 0F1 0F2 0F3 .   .   .   0B0 0F4 ...
    rank 3 | .   .   .   3F0 3F1 3F2 ...        rank 3 | .   .   .   3F0 3B0 3F1 3B1 3F2 ...

Both leave (p-1)(F+B) idle per rank, a fraction (p-1)/m of the ideal compute
(Narayanan et al. SC'21, arXiv:2104.04473, Sec 2.2); 1F1B holds at most p microbatches of
activations where GPipe holds m (Fan et al. 2021 "DAPPLE"; Narayanan et al. 2019
"PipeDream-Flush").

Interleaved 1F1B (Narayanan et al. SC'21 Sec 2.2.2) cuts the model into p*v parts; virtual
stage k = part k runs on rank k % p, so each rank holds v chunks and a microbatch crosses the
ranks v times. p=2, v=2, m=4 in chunk units (F = B = 1 per chunk; stages 0, 2 on rank 0)::

    rank 0  | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 .   2B2 .   2B3 0B2 0B3
    rank 1  | .   1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 .

The bubble shrinks to (p-1)(F+B)/v, a fraction (p-1)/(v*m), at the price of v times more
point-to-point traffic.
"""

from __future__ import annotations

from .core import Action, PipelineSchedule, ScheduleError, make_schedule


def _check_pm(name: str, p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ScheduleError(f"{name}: need p >= 1 ranks and m >= 1 microbatches; got p={p}, m={m}",
                            about="p" if p < 1 else "m")


def gpipe(p: int, m: int) -> PipelineSchedule:
    """All forwards, then all backwards in microbatch order (torch ScheduleGPipe order)."""
    _check_pm("gpipe", p, m)
    rows = [[Action(s, "F", i) for i in range(m)] + [Action(s, "B", i) for i in range(m)] for s in range(p)]
    return make_schedule("gpipe", rows)


def one_f_one_b(p: int, m: int, combined: bool = False) -> PipelineSchedule:
    """1F1B (PipeDream-Flush): p-s-1 warm-up forwards, then alternate, then drain backwards.

    ``combined`` (Megatron-LM's combined 1F1B, ``--overlap-moe-expert-parallel-comm``; its
    ``combined_1f1b_schedule_for_no_pipelining`` at p = 1): one more warm-up forward, and each
    steady-state forward runs with the backward after it as one overlapped chunk, where one
    microbatch's all-to-alls hide under the other's compute (its
    ``combined_forward_backward_step``); warm-up and cool-down run alone::

        p = 1, m = 4    F0 [F1 & B0] [F2 & B1] [F3 & B2] B3
    """
    _check_pm("1f1b", p, m)
    rows, pairs = [], []
    for s in range(p):
        warm = min(p - s - 1 + combined, m)
        acts = [Action(s, "F", i) for i in range(warm)]
        steady = [(Action(s, "F", warm + i), Action(s, "B", i)) for i in range(m - warm)]
        acts += [a for pair in steady for a in pair] + [Action(s, "B", i) for i in range(m - warm, m)]
        rows.append(acts)
        pairs.append(steady if combined else [])
    return make_schedule("1f1b", rows, fb_pairs=pairs)


def interleaved_warmup(p: int, m: int, v: int, rank: int, group: int | None = None) -> int:
    """Forwards (chunk-microbatches) rank ``rank`` runs before its first backward.

    As Megatron-LM's ``forward_backward_pipelining_with_interleaving``: when m == p every
    forward goes first; otherwise (p - rank - 1) * 2 + (v - 1) * g, capped at m * v, g the
    microbatch group (:func:`interleaved_table`, p by default). The extra g per extra chunk
    lets the first microbatch group reach the last chunk before the first backward arrives;
    the factor 2 staggers ranks by one F and one B each.
    """
    total = m * v
    g = p if group is None else group
    if m == p == g:
        return total
    return min((p - rank - 1) * 2 + (v - 1) * g, total)


def interleaved_group_error(p: int, m: int, group: int | None) -> str | None:
    """Why microbatch groups of ``group`` (default p) cannot order m microbatches over p ranks,
    or None: Megatron-LM takes a group from p to m microbatches whose last group is whole or
    holds at least p. It refuses a shorter last group: its microbatches reach the next chunk
    before the pipeline has passed them on, so ranks wait on each other (idle time, and for some
    m and v, such as p=4, m=5, v=3, a deadlock)."""
    g = p if group is None else group
    if m < p:
        return f"needs at least as many microbatches as pipeline ranks; got m={m}, p={p}"
    if not p <= g <= m:
        return f"a microbatch group holds from p={p} to m={m} microbatches; got {g}"
    if 0 < m % g < p:
        hint = ("a multiple of p, or a larger group chosen" if group is None
                else f"a multiple of the group ({g}), or another group chosen")
        return (f"m={m} microbatches in groups of {g} leave a last group of {m % g}, fewer than p={p}, which "
                f"Megatron-LM refuses (its ranks would wait on each other); m must be {hint} whose last group "
                f"holds at least p")
    return None


def interleaved_table(p: int, m: int, v: int, group: int | None = None) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each chunk-microbatch k = 0 .. m*v-1, in the order a rank runs
    them: microbatches in groups of ``group`` (p by default), each group through chunk 0, then
    chunk 1, ...; the last group holds what is left (Megatron-LM's ``get_schedule_table``, the
    group its ``microbatch_group_size_per_vp_stage``). group=3, m=5, v=2 (groups 0 1 2 | 3 4,
    the example of Megatron-LM's docstring)::

        k          0 1 2 3 4 5 6 7 8 9
        microbatch 0 1 2 0 1 2 3 4 3 4
        chunk      0 0 0 1 1 1 0 0 1 1
    """
    g = p if group is None else group
    return [(mb, chunk) for first in range(0, m, g) for chunk in range(v) for mb in range(first, min(first + g, m))]


DEFAULT_CHUNKS = 2  # interleaved's model chunks per rank where none are given


def interleaved(p: int, m: int, v: int = DEFAULT_CHUNKS, group: int | None = None,
                combined: bool = False) -> PipelineSchedule:
    """Megatron interleaved 1F1B: v chunks per rank, microbatches taken p (or ``group``) at a
    time per chunk.

    For rank r, with k = 0 .. m*v-1 counting chunk-microbatches in the order of
    :func:`interleaved_table` ((mb, chunk) of k)::

        F(k)   = microbatch mb(k) on chunk chunk(k)          # p microbatches on chunk 0, then chunk 1, ...
        B(k)   = microbatch mb(k) on chunk v - 1 - chunk(k)  # backwards start from the last chunk
        order  = F(0..w-1), then F(w+k) B(k) pairs, then the remaining B's

    With m a multiple of p and groups of p, mb(k) = (k div p*v) * p + k mod p and chunk(k) =
    (k mod p*v) div p. Groups of more than p (Megatron-LM's
    ``--microbatch-group-size-per-virtual-pipeline-stage``) also take an m that p does not
    divide, where the last group holds at least p (:func:`interleaved_group_error`).

    ``combined`` (Megatron-LM's combined 1F1B, ``--overlap-moe-expert-parallel-comm``): one
    more warm-up forward on every rank (Megatron-LM adds it; without it the last rank's first
    steady pair would be one microbatch's forward and backward on its last chunk), and each
    ``F(w+k) B(k)`` pair one overlapped chunk.
    """
    _check_pm("interleaved", p, m)
    if v < 2:
        raise ScheduleError(f"interleaved: needs v >= 2 model chunks per rank; got v={v} (v=1 is plain 1f1b)",
                            about="v")
    if p < 2:
        # Megatron-LM refuses it too: with one rank the chunks are one stage run in pieces.
        raise ScheduleError("interleaved: needs p >= 2 pipeline ranks to interleave chunks over; got p=1 "
                            "(one rank runs its chunks as one stage: use 1f1b)", about="p")
    why = interleaved_group_error(p, m, group)
    if why is not None:  # (m too small, or a group that does not fit it: the group's when one is given)
        raise ScheduleError(f"interleaved: {why}", about="m" if group is None or m < p else "group")
    total = m * v
    table = interleaved_table(p, m, v, group)

    def act(rank: int, k: int, kind: str) -> Action:
        mb, chunk = table[k]
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(chunk * p + rank, kind, mb)

    rows, pairs = [], []
    for r in range(p):
        warm = min(interleaved_warmup(p, m, v, r, group) + combined, total)
        acts = [act(r, k, "F") for k in range(warm)]
        steady = [(act(r, warm + k, "F"), act(r, k, "B")) for k in range(total - warm)]
        acts += [a for pair in steady for a in pair] + [act(r, k, "B") for k in range(total - warm, total)]
        rows.append(acts)
        pairs.append(steady if combined else [])
    return make_schedule("interleaved", rows, fb_pairs=pairs)
