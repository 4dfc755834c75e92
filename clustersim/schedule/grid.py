"""Schedules as text: the step x rank grid, and user schedules in torch pipelining notation.

:func:`format_grid` prints the unit-time placement, one row per rank, ``.`` for an idle slot;
an overlapped backward is marked ``&`` (it runs together with the forward before it), and a
split backward whose W follows at once is written ``I`` (torch's backward-input), so that it
reads back split: a ``B`` right before its own ``W`` is the two halves of a full backward::

    rank 0  | 0F0 0F1 0F2 0F3 .   .   .   0B0 0F4 0B1 ...
    rank 1  | .   1F0 1F1 1F2 .   .   1B0 1F3 1B1 1F4 ...

:func:`parse_grid` reads that back, and also what users write by hand or export from
torch.distributed.pipelining: one line per rank, tokens ``{stage}{F|B|I|W}{mb}`` separated by
spaces, or CSV rows with empty cells (or ``.``) for idle slots::

    0F0,0F1,,0I0,0W0,0F2          # torch's I (backward input): B split from its W, which
    ,1F0,1B0,1W0,1F1,...          # holds what W reads until it runs; B right before its W:
                                  # a full backward; B with its W later: split too; with no
                                  # W anywhere, B is the full backward

An overlapped chunk's backward is a full one (schedule/core.py), so ``&I`` right before its
own W is refused: write ``&B``.

Only the order of a row matters; where the idle cells sit does not (time is recomputed from
the dependencies). torch's communication and FSDP tokens (``SEND_F``, ``RECV_B``,
``UNSHARD``...) are skipped: clustersim derives communication itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .core import (Action, PipelineSchedule, ScheduleError, as_schedule, fused_after_b, make_schedule,
                   split_weight_passes, unit_time_grid)

# ASCII digits only: \d would take full-width and other scripts' digits (０F0) as numbers
_TOKEN = re.compile(r"^(&?)([0-9]+)([FBIW])([0-9]+)$")
_TORCH_COMM = re.compile(r"^[0-9]+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)[0-9]*$")
_ROW_LABEL = re.compile(r"^\s*rank\s+([0-9]+)\s*$")


def format_grid(schedule: PipelineSchedule | Sequence[Sequence[Action]]) -> str:
    """The step x rank grid in unit time: ``rank R  | tokens``, ``.`` for an idle slot."""
    s = as_schedule(schedule)
    grid = unit_time_grid(s)
    marked = [set(s.overlapped_with(r)) for r in range(s.ranks)]
    split_at_once = [_split_before_w(s, r) for r in range(s.ranks)]

    def cell(r: int, a: Action | None) -> str:
        if a is None:
            return "."
        text = f"{a.stage}I{a.mb}" if a in split_at_once[r] else str(a)
        return ("&" if a in marked[r] else "") + text

    width = max(len(cell(r, a)) for r, row in enumerate(grid) for a in row)
    lines = []
    for r, row in enumerate(grid):
        cells = " ".join(cell(r, a).ljust(width) for a in row)
        lines.append(f"rank {r:<3}| {cells}".rstrip())
    return "\n".join(lines)


def _split_before_w(s: PipelineSchedule, r: int) -> set[Action]:
    """Rank r's split backwards (B) written right before their own W: those :func:`format_grid`
    writes ``I``, as a ``B`` there reads back as a full backward's first half."""
    return {Action(stage, "B", mb) for stage, mb in fused_after_b(s.actions[r]) & split_weight_passes(s, r)}


def _fused(rows: list[list[Action]], split: list[set]) -> list[frozenset]:
    """Per rank, (stage, mb) of each W that is a full backward's second half: written right
    after its own B, where that B was not written ``I``."""
    return [frozenset(fused_after_b(acts) - sp) for acts, sp in zip(rows, split)]


def parse_rows(text: str) -> tuple[list[list[Action]], list[list[tuple[Action, Action]]], list[set]]:
    """Text -> per-rank actions, overlapped (F, B) pairs and the (stage, mb) of backwards
    written ``I`` (split from their W), checking only the tokens.

    Lines: optional ``rank R |`` label, then cells split on commas (CSV) or whitespace.
    Blank lines and ``#`` comments are skipped. B/I/W are resolved as described above.
    """
    raw: list[list[tuple[int, str, str, bool]]] = []  # per row: (cell index, token, kind, overlapped)
    toks: list[list[tuple[int, int, str, int]]] = []
    for line in text.splitlines():
        body = line.split("#", 1)[0]
        if not body.strip():
            continue
        label, bar, rest = body.partition("|")
        if bar:
            m = _ROW_LABEL.match(label)
            if not m:
                raise ScheduleError(f"line {line.strip()!r}: expected 'rank R | tokens' before '|'")
            if int(m.group(1)) != len(raw):
                raise ScheduleError(f"row labelled rank {m.group(1)} is row {len(raw)}; list ranks 0, 1, 2... in order")
            body = rest
        cells = [c.strip() for c in body.split(",")] if "," in body else body.split()
        r = len(raw)
        row, parsed = [], []
        for i, tok in enumerate(cells):
            if tok in ("", ".") or _TORCH_COMM.match(tok):
                continue
            m = _TOKEN.match(tok)
            if not m:
                raise ScheduleError(f"rank {r}, cell {i}: {tok!r} is not an action; expected "
                                    f"{{stage}}{{F|B|I|W}}{{mb}} such as 3F1 or 2W0, or '.' for idle")
            amp, stage, kind, mb = m.groups()
            if amp and kind not in "BI":
                raise ScheduleError(f"rank {r}, cell {i}: {tok!r}: only a backward (B or I) can be marked '&' "
                                    f"(overlapped with the forward before it)")
            row.append((i, tok, kind, bool(amp)))
            parsed.append((i, int(stage), kind, int(mb)))
        raw.append(row)
        toks.append(parsed)
    if not raw:
        raise ScheduleError("schedule text has no rows")
    # every stage and microbatch below a bound needs actions of its own, so none can be
    # numbered past the count of actions (and no array is sized by a number from the file)
    n_actions = sum(map(len, toks))
    for r, (row, parsed) in enumerate(zip(raw, toks)):
        for (i, tok, _, _), (_, stage, _, mb) in zip(row, parsed):
            if stage >= n_actions or mb >= n_actions:
                what = f"stage {stage}" if stage >= n_actions else f"microbatch {mb}"
                raise ScheduleError(f"rank {r}, cell {i}: {tok!r}: {what} cannot be reached: the schedule has "
                                    f"{n_actions} actions, and each stage and microbatch below it needs some")
    has_w = any(kind == "W" for row in toks for (_, _, kind, _) in row)
    w_keys = {(st, mb) for row in toks for (_, st, kind, mb) in row if kind == "W"}
    rows: list[list[Action]] = []
    pairs: list[list[tuple[Action, Action]]] = []
    split: list[set] = []
    for r, (row, parsed) in enumerate(zip(raw, toks)):
        acts: list[Action] = []
        rp: list[tuple[Action, Action]] = []
        split.append({(stage, mb) for (_, stage, kind, mb) in parsed if kind == "I"})
        for (i, tok, _, amp), (_, stage, kind, mb) in zip(row, parsed):
            if kind == "I" and not has_w:
                raise ScheduleError(f"rank {r}, cell {i}: {tok!r} is a backward-input action but the schedule "
                                    f"has no W (weight-gradient) actions; write B for a full backward, or add W")
            if kind == "I" and (stage, mb) not in w_keys:
                raise ScheduleError(f"rank {r}, cell {i}: {tok!r} computes the input gradient only, but there "
                                    f"is no {stage}W{mb} for its weight gradient")
            if kind in "BI":
                b = Action(stage, "B", mb)
                if amp:
                    if not acts or acts[-1].kind != "F":
                        raise ScheduleError(f"rank {r}, cell {i}: {tok!r} is marked '&' (overlapped) but does "
                                            f"not follow a forward on that rank")
                    rp.append((acts[-1], b))
                acts.append(b)
                # torch's B is the full backward: in a split schedule, its weight part is a W right after
                if kind == "B" and has_w and (stage, mb) not in w_keys:
                    acts.append(Action(stage, "W", mb))
            else:
                acts.append(Action(stage, kind, mb))
        at_once = fused_after_b(acts) & split[-1]  # written I, its W right after
        for _, b in rp:  # an overlapped chunk takes a W right after its B as its own: a full backward
            if (b.stage, b.mb) in at_once:
                raise ScheduleError(f"rank {r}: &{b.stage}I{b.mb} is overlapped with the forward before it and its "
                                    f"W follows at once, which makes it a full backward: write &{b.stage}B{b.mb}")
        rows.append(acts)
        pairs.append(rp)
    return rows, pairs, split


def parse_grid(text: str, *, stage_part: Sequence[int] | None = None, name: str = "custom") -> PipelineSchedule:
    """Inverse of :func:`format_grid` (idle cells dropped); also reads hand-written schedules.

    Stage k computes part k unless ``stage_part`` says otherwise (a DualPipe grid needs it:
    its direction-1 stages recompute parts 0..p-1). The result is checked like every schedule
    (each microbatch F/B/W once per stage in order, every part once per microbatch, no
    deadlock); errors name the rank and the token.
    """
    rows, pairs, split = parse_rows(text)
    return make_schedule(name, rows, stage_part=stage_part, fb_pairs=pairs, fused_w=_fused(rows, split))


def parse_schedule(text: str, p: int | None = None, m: int | None = None, *,
                   stage_part: Sequence[int] | None = None, name: str = "custom") -> PipelineSchedule:
    """A user schedule (``build_schedule("custom", p, m, text=...)``): parse, check, and check
    that it has ``p`` rows and ``m`` microbatches when those are given: first on the rows as
    read, so that a row too many or a microbatch past ``m`` is named as such rather than by
    the gap or the missing backward it leaves in the checks after."""
    rows, pairs, split = parse_rows(text)
    if p is not None and len(rows) != p:
        raise ScheduleError(f"custom schedule has {len(rows)} {'row (rank)' if len(rows) == 1 else 'rows (ranks)'} "
                            f"but pp={p}")
    past = [(r, a) for r, row in enumerate(rows) for a in row if m is not None and a.mb >= m]
    if past:
        r, a = past[0]
        raise ScheduleError(f"rank {r}: microbatch {a.mb} is past m={m} (microbatches are numbered 0..{m - 1})")
    s = make_schedule(name, rows, stage_part=stage_part, fb_pairs=pairs,  # (parse_grid, on the rows read)
                      fused_w=_fused(rows, split))
    if m is not None and s.n_microbatches != m:
        raise ScheduleError(f"custom schedule has {s.n_microbatches} "
                            f"{'microbatch' if s.n_microbatches == 1 else 'microbatches'} but m={m}")
    return s
