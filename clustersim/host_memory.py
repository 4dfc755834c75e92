"""What a run of clustersim needs of the machine's memory, known before it runs.

A run holds every task of its step at its peak: the program, the engine's records, the
spans, the analysis' columns, and the report and trace written by a forked process. Its
memory grows with the step's tasks, about the same per task whatever the plan, and with the
cluster's GPUs (their routes, the orbit plans of collectives over thousands of replicas, the
flow network's arrays over every link)::

    bytes(run) ~ RUN_BASE_BYTES + RUN_BYTES_PER_TASK * tasks(step) + RUN_BYTES_PER_GPU * GPUs

A collapsed run holds a few ranks' tasks (moe_1024gpu: 15,575, about 0.1 GB); every rank
simulated holds them all (moe_1024gpu: 1,993,600, about 3.8 GB; Megatron-1T's 3,072 ranks:
41 M, about 60 GB). A run that would need more than the machine has free is refused before
it starts, with what it would take, instead of swapping for hours or being killed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .analysis.columns import TaskColumns
from .errors import ConfigError
from .forking import WorkerSlots
from .program.tasks import Program

# `clustersim run --all-ranks`, the summed PSS of its processes at their peak (the parent, the
# writer it forks, the shorter step's process; bench/bench_memory.py, 2026-12-03, before the TP
# backward was cut at its GEMM, which added tasks to the TP plans): long_context_cp_128k
# 638 MiB for 371,808 tasks, llama2_70b_64gpu 968 MiB for 669,056, moe_1024gpu 3,290 MiB for
# 2,308,608, gpt3_175b_1024gpu 13,128 MiB for 9,893,120: 1.36-1.52 KB a task above a process's
# own 100 MiB (those runs' moe_1024gpu was its PP16 DualPipe plan; its PP8 interleaved plan
# takes 3,811 MiB for 1,993,600, 1.95 KB a task, 2026-12-04: the figure is a low end, so that a
# run is refused only where even it would not fit). A step whose cycle is copied in holds its
# copies' spans more cheaply (Megatron-1T collapsed: 820 MiB for 854,340 tasks, 1,322 MiB expected).
RUN_BYTES_PER_TASK = 1_500
RUN_BASE_BYTES = 100 * 2**20
# collapsed runs of large clusters, the same PSS (bench/bench_memory.py --collapsed), above
# the base and their tasks' share: 17 KB a GPU for the sweep's dense plan from 16,384 to
# 65,536 GPUs (1,186 MiB at 65,536), 22-30 KB for Llama-3-like plans (1,989 MiB at 65,536),
# 38 KB for GB200 trees, 58 KB for MoE on DGX pods (moe_16k 1,066 MiB, 32,768 GPUs 1,975 MiB),
# 99 KB for all-to-alls across a Clos without rails (16k_moe_roce 1,666 MiB). The low end:
# a run is refused only where even that would not fit
RUN_BYTES_PER_GPU = 16_000
# a run expected to need less is not weighed against the machine (asking costs an import)
UNWEIGHED_BYTES = 2**30


def rank_by_rank_tasks(prog: Program) -> int:
    """The tasks of ``prog``'s step with every rank simulated: each simulated rank's tasks
    times the ranks it stands for (``Program.weight``), which run the same program::

        tasks(all ranks) = sum over simulated r of tasks(r) * weight(r)

    llama2_70b_64gpu: 62,424 tasks on 4 ranks of weight 16 -> 998,784, the all-ranks
    lowering's count exactly (tests/test_host_memory.py)."""
    counts = np.bincount(TaskColumns(prog.items, prog.runs, prog).rank, minlength=max(prog.ranks) + 1)
    return sum(int(counts[r]) * prog.weight[r] for r in prog.ranks)


def run_bytes(tasks: int, gpus: int = 0) -> int:
    """The memory a run of a step of ``tasks`` tasks on ``gpus`` GPUs takes at its peak
    (module docstring)."""
    return RUN_BASE_BYTES + RUN_BYTES_PER_TASK * tasks + RUN_BYTES_PER_GPU * gpus


def gpus_weigh_more(tasks: int, gpus: int) -> bool:
    """Whether the cluster's GPUs take more of a run's memory than its step's tasks
    (:func:`run_bytes`' two terms): what a refusal should name."""
    return RUN_BYTES_PER_GPU * gpus > RUN_BYTES_PER_TASK * tasks


def available_bytes() -> int:
    """The memory the machine can give a new process now, without swapping: what the system
    has available, or what is left under this process's cgroup limit where that is less (a
    container's: the system's figure is the host's)."""
    import psutil  # only for the runs large enough to ask

    have = psutil.virtual_memory().available
    room = cgroup_room_bytes()
    return have if room is None else min(have, room)


# cgroup v2, then v1: (limit, usage, statistics, the reclaimable page cache's key in them)
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_FILES = (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
                 "total_inactive_file"))


def cgroup_room_bytes() -> int | None:
    """Memory left under this process's cgroup memory limit; None where it has none. The
    usage counts the page cache, of which the inactive part is reclaimed before anything is
    killed, so it is taken off, as container runtimes do::

        room = limit - (usage - inactive_file)
    """
    for limit_name, usage_name, stat_name, cache_key in CGROUP_FILES:
        try:
            text = (CGROUP_ROOT / limit_name).read_text().strip()
            limit = None if text == "max" else int(text)
            usage = int((CGROUP_ROOT / usage_name).read_text())
        except (OSError, ValueError):
            continue
        if limit is None or limit >= 2**62:  # (v1 writes "no limit" as a page-rounded 2^63)
            return None
        cache = 0
        try:
            for line in (CGROUP_ROOT / stat_name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == cache_key:
                    cache = int(value)
        except (OSError, ValueError):
            pass
        return max(limit - max(usage - cache, 0), 0)
    return None


def check_fits(tasks: int, gpus: int, what: str, remedy: str, *, source: str | None, field: str | None) -> None:
    """Refuse (ConfigError) a run of ``tasks`` tasks on ``gpus`` GPUs that would need more
    memory than the machine has available: ``what`` says which run, ``remedy`` what to do
    instead. In a search's worker (:func:`shared`) the run also waits while the other
    workers' runs hold what it needs (:func:`_reserve`)."""
    need = run_bytes(tasks, gpus)
    if need <= UNWEIGHED_BYTES:
        return
    have = available_bytes() if _LEDGER is None else _reserve(_LEDGER, need)
    if need > have:
        raise ConfigError(f"{what}: {tasks:,} tasks on {gpus:,} GPUs, about {need / 2**30:.1f} GiB of memory (about "
                          f"{RUN_BYTES_PER_TASK / 1000:.1f} KB a task and {RUN_BYTES_PER_GPU / 1000:.0f} KB a GPU), "
                          f"and this machine has {have / 2**30:.1f} GiB available: {remedy}",
                          source=source, field=field)


# the search's workers and the bytes each one's run was weighed at (:func:`shared`); None: none
_LEDGER: WorkerSlots | None = None
# how long a waiting run sleeps before it looks again (a run takes seconds or more)
LEDGER_POLL_S = 0.2


@contextmanager
def shared(workers: int) -> Iterator[None]:
    """Runs in the processes forked inside the block (a search's ``workers``) weigh their
    memory together: each is weighed against what the machine has available less what the
    others' runs were weighed at, and waits while that is too little (:func:`_reserve`).

    Two workers each weighing against the machine alone both pass where their runs start
    together and together exceed it (advise over GPT-3's plans with each DP replica apart
    reached 18 of 23 GB)."""
    global _LEDGER
    _LEDGER = WorkerSlots(workers)
    try:
        yield
    finally:
        _LEDGER = None


def _reserve(ledger: WorkerSlots, need: int) -> int:
    """Wait until a run needing ``need`` bytes fits beside the other workers' runs, then hold
    ``need`` in this process's slot; the memory it was weighed against (too little where it
    would not fit even with the bytes the others hold freed: refused then, not waited for)::

        runs    where need <= available - held      (held: the others' runs' weighed bytes)
        refused where need >  available + held
        waits   otherwise, looking again every LEDGER_POLL_S

    Conservative: what the others already use is counted in both terms, so two runs that
    would fit together may run one after the other. The weighed bytes are low estimates
    (``RUN_BYTES_PER_TASK``), so two runs may still together exceed what they were weighed
    at, and a run near the machine's limit may be refused beside another where alone it
    would have run. A worker that ended without releasing (killed) holds nothing."""
    me = os.getpid()
    while True:
        with ledger.lock:
            ledger.reap()
            others = ledger.others(me)
            have = available_bytes()
            if need <= have - others:
                ledger.set(me, need)
                return have - others
            if not others or need > have + others:  # (not even with theirs freed)
                return have
        time.sleep(LEDGER_POLL_S)


@contextmanager
def released() -> Iterator[None]:
    """A worker's run: what it held in the ledger is freed at its end."""
    try:
        yield
    finally:
        if _LEDGER is not None:
            _LEDGER.mark(0)
