"""Pipeline schedules by name: ``build_schedule(name, p, m, **opts)`` -> PipelineSchedule.

    name          rank holds              backward     bubble per rank (F, full B, W)    needs
    gpipe         stage r                 B            (p-1)(F+B)                        -
    1f1b          stage r                 B            (p-1)(F+B)                        -
    interleaved   stages r, r+p, ...      B            (p-1)(F+B)/v                      m % p == 0 (or group), v >= 2
    zb-h1         stage r                 B + W        (p-1)(F+B-2W)                     -
    zbv           stages r, 2p-1-r        B + W        (p-1) F/2 at T_F = T_B = T_W      -
    dualpipe      stages r, 2p-1-r        B + W, F&B   (p/2-1)(F&B+B-3W)                 p even, m even, m >= 2p
    dualpipev     stages r, 2p-1-r        B + W, F&B   (p-1)(F&B+B-3W), part times      p >= 2, m >= 2p
    custom        as written              as written   -                                 text=...

Sources: Narayanan et al. SC'21 (arXiv:2104.04473) Sec 2.2; Qi et al. 2023 (arXiv:2401.10241);
Qi et al. 2023 Sec 6 (ZB-V); DeepSeek-V3 report (arXiv:2412.19437) Sec 3.2.1, Table 2;
DualPipeV: DeepSeek's DualPipe repository. Every schedule prints as a step x rank grid
(:func:`format_grid`) and parses back (:func:`parse_grid`)::

    rank 0  | 0F0 0F1 0F2 0F3 .   .   .   0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 .   0B5 .   0B6 .   0B7
    rank 3  | .   .   .   3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 .   .   .

The data model (virtual stages, parts, microbatch paths, dependencies, unit-time placement)
lives in :mod:`.core`; the text forms in :mod:`.grid`.
"""

from __future__ import annotations

from .classic import DEFAULT_CHUNKS, gpipe, interleaved, interleaved_warmup, one_f_one_b
from .core import (
    DEFAULT_DURATIONS,
    FB,
    KINDS,
    Action,
    PipelineSchedule,
    Schedule,
    ScheduleError,
    Timeline,
    as_schedule,
    dependencies,
    idle_per_rank,
    make_schedule,
    peak_in_flight,
    timeline,
    unit_time_grid,
)
from .dualpipe import dualpipe, dualpipe_stage_part, dualpipev
from .grid import format_grid, parse_grid, parse_rows, parse_schedule
from .zero_bubble import zb_h1, zb_v

# Schedules built from (p, m) alone; "custom" also takes text=... (see build_schedule).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipe", "dualpipev")
CUSTOM = "custom"
V_SCHEDULES = ("zbv", "dualpipev")  # two model chunks a rank, stages r and 2p-1-r
SCHEDULE_NAMES = SCHEDULES + (CUSTOM,)

__all__ = [
    "CUSTOM", "DEFAULT_DURATIONS", "FB", "KINDS", "SCHEDULES", "SCHEDULE_NAMES", "V_SCHEDULES", "Action",
    "PipelineSchedule",
    "Schedule", "ScheduleError", "Timeline", "action_deps", "as_schedule", "build_schedule", "chunks_per_rank",
    "dependencies",
    "dualpipe", "dualpipe_stage_part", "dualpipev", "format_grid", "gpipe", "idle_per_rank", "interleaved",
    "interleaved_warmup", "make_schedule", "one_f_one_b", "parse_grid", "parse_rows", "parse_schedule",
    "peak_in_flight", "timeline", "unit_time_grid", "zb_h1", "zb_v",
]


def build_schedule(name: str, p: int, m: int, **opts) -> PipelineSchedule:
    """The schedule ``name`` for p pipeline ranks and m microbatches.

    Options: ``interleaved``: ``v`` (model chunks per rank, default 2), ``group`` (microbatches a
    chunk runs before the next, default p; :func:`.classic.interleaved_table`); ``interleaved``
    and ``1f1b``: ``combined`` (steady-state forwards and backwards paired into overlapped
    chunks, Megatron-LM's combined 1F1B). ``custom``: ``text``
    (required; one row per rank, see :mod:`.grid`), ``stage_part`` (virtual stage -> model
    part, default stage k computes part k), ``name``. Raises KeyError for an unknown name,
    ScheduleError (a ValueError) for parameters the schedule cannot take.
    """
    allowed = {"interleaved": {"v", "group", "combined"}, "1f1b": {"combined"},
               CUSTOM: {"text", "stage_part", "name"}}.get(name, set())
    if name in SCHEDULE_NAMES and set(opts) - allowed:
        extra = ", ".join(sorted(set(opts) - allowed))
        raise ScheduleError(f"{name}: unknown option(s) {extra}; it takes {', '.join(sorted(allowed)) or 'none'}")
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m, **opts)
    if name == "interleaved":
        return interleaved(p, m, **opts)
    if name == "zb-h1":
        return zb_h1(p, m)
    if name == "zbv":
        return zb_v(p, m)
    if name == "dualpipe":
        return dualpipe(p, m)
    if name == "dualpipev":
        return dualpipev(p, m)
    if name == CUSTOM:
        if "text" not in opts:
            raise ScheduleError("custom: pass the schedule as text=... (one row of tokens per rank)")
        return parse_schedule(opts["text"], p, m, stage_part=opts.get("stage_part"), name=opts.get("name", CUSTOM))
    raise KeyError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}")


def chunks_per_rank(name: str, v: int | None = None) -> int:
    """The model chunks of one rank a microbatch passes: ``v`` under interleaved (default 2),
    2 under zbv and dualpipev (the V's two arms), else 1 (DualPipe's two parts each take half
    the microbatches). A step issues p x m x this many forwards: what the size limits count."""
    if name == "interleaved":
        return DEFAULT_CHUNKS if v is None else v
    return 2 if name in V_SCHEDULES else 1


def action_deps(a: Action, last_stage: int) -> list[tuple[int, str, int]]:
    """Dependencies in a linear pipeline (stage k on rank k, every microbatch through 0..last).

    Kept for callers of the old API; for any schedule use ``schedule.deps(a)``.
    """
    if a.kind == "F":
        return [(a.stage - 1, "F", a.mb)] if a.stage > 0 else []
    if a.kind == "W":
        return [(a.stage, "B", a.mb)]
    deps = [(a.stage, "F", a.mb)]
    if a.stage < last_stage:
        deps.append((a.stage + 1, "B", a.mb))
    return deps
