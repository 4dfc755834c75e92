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
        raise ScheduleError(f"{name}: need p >= 1 ranks and m >= 1 microbatches; got p={p}, m={m}")


def gpipe(p: int, m: int) -> PipelineSchedule:
    """All forwards, then all backwards in microbatch order (torch ScheduleGPipe order)."""
    _check_pm("gpipe", p, m)
    rows = [[Action(s, "F", i) for i in range(m)] + [Action(s, "B", i) for i in range(m)] for s in range(p)]
    return make_schedule("gpipe", rows)


def one_f_one_b(p: int, m: int) -> PipelineSchedule:
    """1F1B (PipeDream-Flush): p-s-1 warm-up forwards, then alternate, then drain backwards."""
    _check_pm("1f1b", p, m)
    rows = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts = [Action(s, "F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action(s, "F", warm + i), Action(s, "B", i)]
        acts += [Action(s, "B", i) for i in range(m - warm, m)]
        rows.append(acts)
    return make_schedule("1f1b", rows)


def interleaved_warmup(p: int, m: int, v: int, rank: int) -> int:
    """Forwards (chunk-microbatches) rank ``rank`` runs before its first backward.

    As Megatron-LM's ``forward_backward_pipelining_with_interleaving``: when m == p every
    forward goes first; otherwise (p - rank - 1) * 2 + (v - 1) * p, capped at m * v. The
    extra p per extra chunk lets the first microbatch group reach the last chunk before the
    first backward arrives; the factor 2 staggers ranks by one F and one B each.
    """
    total = m * v
    if m == p:
        return total
    return min((p - rank - 1) * 2 + (v - 1) * p, total)


def interleaved(p: int, m: int, v: int = 2) -> PipelineSchedule:
    """Megatron interleaved 1F1B: v chunks per rank, microbatches taken p at a time per chunk.

    Roughly, for rank r, with iteration k = 0 .. m*v-1 counting chunk-microbatches::

        chunk_F(k) = (k mod p*v) div p            # p microbatches on chunk 0, then chunk 1, ...
        chunk_B(k) = v - 1 - chunk_F(k)           # backwards start from the last chunk
        mb(k)      = (k div p*v) * p + k mod p
        order      = F(0..w-1), then F(w+k) B(k) pairs, then the remaining B's
    """
    _check_pm("interleaved", p, m)
    if v < 2:
        raise ScheduleError(f"interleaved: needs v >= 2 model chunks per rank; got v={v} (v=1 is plain 1f1b)")
    if m % p:
        raise ScheduleError(f"interleaved: the number of microbatches must be a multiple of the pipeline size "
                            f"(Megatron-LM runs them in groups of p per chunk); got m={m}, p={p}")
    total = m * v

    def act(rank: int, k: int, kind: str) -> Action:
        chunk = (k % (p * v)) // p
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(chunk * p + rank, kind, (k // (p * v)) * p + k % p)

    rows = []
    for r in range(p):
        warm = interleaved_warmup(p, m, v, r)
        acts = [act(r, k, "F") for k in range(warm)]
        for k in range(total - warm):
            acts += [act(r, warm + k, "F"), act(r, k, "B")]
        acts += [act(r, k, "B") for k in range(total - warm, total)]
        rows.append(acts)
    return make_schedule("interleaved", rows)
