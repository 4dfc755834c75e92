"""A sweep of plans: one scenario with every combination of the values given, simulated and
ranked (``clustersim sweep``).

    python -m clustersim sweep scenarios/llama2_70b_64gpu.yaml \\
        --vary parallel.tp=2,4,8 --vary parallel.pp=1,2,4,8 --vary training.recompute=selective,full

Roughly::

    for values in product(tp values, pp values, recompute values):      # in the order given
        plan = the file with those values set                            (clustersim.overrides)
        parallel.dp = GPUs / (tp x pp x cp) unless dp itself is varied   (dp follows)
        the file's layers_per_stage dropped where pp, vpp or the schedule differ, unless varied
        refused by the scenario's rules?  -> listed with the rule's one line, not simulated
        --skip-unfit and its memory floor above the GPU's?  -> listed with it, not simulated
        else simulate it as ``run`` does  -> step, tokens/s, MFU, bubble, exposed, peak memory
    rank: plans that fit by tokens/s, then those that do not (the step they would take)

The plans are independent, so ``--jobs N`` simulates them in N forked processes; the ranking
and the files do not depend on N (but for a plan refused as too large for the machine's
memory beside another's run: host_memory.check_fits).
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .forking import WorkerSlots
from .overrides import changes_text, repeats
from .yamlio import read_yaml, short_repr

# the degrees whose product with dp is the world size (ep is carved out of dp; config)
_MESH = ("parallel.tp", "parallel.pp", "parallel.cp")
DP = "parallel.dp"
VPP = "parallel.vpp"
SPLIT = "parallel.layers_per_stage"
_PARTS = ("parallel.pp", "parallel.vpp", "parallel.schedule", "parallel.schedule_file")  # what the split is per
SWEEP_FILES = ("sweep.json", "sweep.csv", "sweep.html")
# what a sweep keeps of each plan's summary (a thousand whole summaries would be hundreds of MB)
FIGURES = ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "bubble_fraction")
CSV_COLUMNS = ("plan", "status") + FIGURES + ("compute_s", "exposed_comm_s", "bubble_s", "peak_bytes",
                                              "capacity_bytes", "fits", "tight", "host_fits", "reason", "floor_bytes",
                                              "estimate")
# after a plan's step in the tables: its step is an estimate, some of its communications at
# their slowest twin's pace (``simulation.asymmetric_orbits``; the row's ``estimate``); an
# unmarked step keeps its place with a figure space (a plain one collapses in HTML)
ESTIMATE_MARK, NO_MARK = "~", "\u2007"


def split_values(text: str) -> list[str]:
    """``"1,2,[4, 4],'a,b'"`` as ``["1", "2", "[4, 4]", "'a,b'"]``: commas inside brackets,
    braces or quotes do not split."""
    out, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur))
    return out


def parse_vary(text: str, *, source: str = "command line", field: str = "--vary") -> tuple[str, list[Any]]:
    """``"parallel.tp=1,2,4,8"`` as ``("parallel.tp", [1, 2, 4, 8])``: a dotted key and its
    values, comma-separated (:func:`split_values`), each read as YAML."""
    from .overrides import check_key, parse_value

    key, eq, raw = text.partition("=")
    where = f"{field} {text!r}"
    if not eq:
        raise ConfigError(f"{short_repr(text)} is not KEY=V1,V2,... (e.g. parallel.tp=1,2,4,8)", source=source,
                          field=where)
    check_key(key, source=source, field=where, what=text)
    values: list[Any] = []
    for item in split_values(raw):
        if not item.strip():
            raise ConfigError(f"{key}: an empty value in {short_repr(raw)}", source=source, field=where)
        value = parse_value(key, item.strip(), source=source, field=where)
        if value in values:
            raise ConfigError(f"{key}: {short_repr(item.strip())} is given twice", source=source, field=where)
        values.append(value)
    return key, values


@dataclass
class Plan:
    """One plan of a sweep: its number (from 1, in the order of the product) and changes."""

    number: int
    changes: list[tuple[str, Any]]


def plans_of(varies: list[tuple[str, list[Any]]], paired: bool = False) -> list[Plan]:
    """Every combination of the values, the first key's slowest (itertools.product); with
    ``paired``, the keys' n-th values together, one plan each (the lists as long as each
    other: ``sweep --zip``, a weak-scaling sweep of nodes and batch)."""
    keys = [k for k, _ in varies]
    combos = zip(*(v for _, v in varies)) if paired else itertools.product(*(v for _, v in varies))
    return [Plan(i + 1, list(zip(keys, values))) for i, values in enumerate(combos)]


def value_at(data: dict[str, Any], key: str) -> Any:
    """The value of the dotted ``key`` in the nested ``data`` (None where a part is missing
    or runs through a value)."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def degrees_of(sc) -> dict[str, Any]:
    """A loaded plan's ``dp`` and ``vpp`` (its model chunks a rank where it interleaves, else
    None: no other schedule has virtual stages), for its row: the changes alone do not say
    them where the plan keeps the file's."""
    p = sc.parallel
    return {"dp": p.dp, "vpp": p.vpp if p.schedule == "interleaved" else None}


def asked_degrees(data: dict[str, Any], changes: list[tuple[str, Any]]) -> dict[str, Any]:
    """:func:`degrees_of` a plan that does not load (refused by a rule, or its worker killed):
    what the file's ``data`` with its ``changes`` gives, unset keys at their defaults (None
    where the changes cannot be made)."""
    from .config import ParallelCfg
    from .overrides import apply_changes

    try:
        d = apply_changes(data, changes, source="sweep")
    except ConfigError:
        return {"dp": None, "vpp": None}

    def value(key: str) -> Any:
        v = value_at(d, key)
        return ParallelCfg.model_fields[key.split(".")[1]].default if v is None else v

    return {"dp": value(DP), "vpp": value(VPP) if value("parallel.schedule") == "interleaved" else None}


def with_dp(data: dict[str, Any], plan: Plan, gpus_per_node: int, base_nodes: int,
            base_dir: Path | None = None) -> tuple[Plan, str | None]:
    """The plan with ``parallel.dp`` made to follow (GPUs / (tp x pp x cp)), or the reason it
    cannot: the changes made to ``data`` (the file's) give tp, pp, cp, ``cluster.nodes``,
    ``cluster.node.gpus`` and ``cluster.topology`` (another topology file: its GPUs a node and
    nodes, read from ``base_dir``, the scenario's folder)."""
    from .overrides import apply_changes

    d = apply_changes(data, plan.changes, source="sweep")
    changed = dict(plan.changes)
    if "cluster.topology" in changed and base_dir is not None and isinstance(changed["cluster.topology"], str):
        from .hardware.topology import load_topology_cfg

        from .overrides import shell_path

        try:  # (read as the variant reads it: from the working folder where not beside the scenario)
            topo = load_topology_cfg(base_dir / shell_path(changed["cluster.topology"], base_dir), build=False)
        except ConfigError:
            return plan, None  # validation names the file
        gpus_per_node, base_nodes = topo.node.gpus, topo.nodes
    nodes = value_at(d, "cluster.nodes") or base_nodes
    gpus_per_node = value_at(d, "cluster.node.gpus") or gpus_per_node  # (the scenario's change of its topology)
    degrees = [value_at(d, k) or 1 for k in _MESH]
    if not all(isinstance(x, int) and x >= 1 for x in (nodes, *degrees)):
        return plan, None  # validation names the bad value
    gpus, mesh = nodes * gpus_per_node, degrees[0] * degrees[1] * degrees[2]
    if gpus % mesh:
        return plan, f"parallel: tp x pp x cp = {' x '.join(map(str, degrees))} = {mesh} does not divide the {gpus:,} GPUs"
    return Plan(plan.number, plan.changes + [(DP, gpus // mesh)]), None


def with_split(data: dict[str, Any], plan: Plan) -> Plan:
    """The plan with the file's ``parallel.layers_per_stage`` left out (the even split) where
    it sets pp, vpp or the schedule to other than the file's, whose model parts the file's
    entries count, unless it sets the split itself (``sweep`` and ``advise`` plans alike).
    A key the file or the plan leaves unset (None) counts as its default."""
    from .config import ParallelCfg

    changed = dict(plan.changes)
    if SPLIT in changed or value_at(data, SPLIT) is None:
        return plan

    def value(key: str, v: Any) -> Any:
        return ParallelCfg.model_fields[key.split(".")[1]].default if v is None else v

    if all(value(k, changed[k]) == value(k, value_at(data, k)) for k in _PARTS if k in changed):
        return plan
    return Plan(plan.number, plan.changes + [(SPLIT, None)])


def simulate_plan(job: tuple[str, dict[str, Any], Plan, bool, bool]) -> dict[str, Any]:
    """Simulate one plan (a worker's job): its row, ``status`` ok, refused (with the rule's
    ``reason``, the field and message of the ConfigError; ``failed`` is the sweep's process's
    row for a plan whose worker was killed, :func:`_simulate_all`) or, where the job says to prune,
    unfit: certain not to fit in memory (``api.memory_floor``), not simulated, with the floor
    as its ``floor_bytes`` (no ``peak_bytes``: it has no simulated peak). Every row has the
    plan's ``dp`` and ``vpp`` (:func:`degrees_of`; a refused plan's as it asks them,
    :func:`asked_degrees`)."""
    from . import host_memory
    from .api import memory_floor, simulate
    from .output.compare import step_split
    from .overrides import load_variant

    path, data, plan, fork, prune = job
    row: dict[str, Any] = {"plan": plan.number, "changes": dict(plan.changes)}
    try:
        sc = load_variant(path, plan.changes, data)
        row.update(degrees_of(sc))
        floor = memory_floor(sc) if prune else None
        if floor is not None and not floor["fits"]:
            return {**row, "status": "unfit", "floor_bytes": floor["peak_bytes"], "capacity_bytes": floor["capacity_bytes"],
                    "fits": False, "reason": unfit_reason(floor)}
        with host_memory.released(), _on_board(plan.number):  # (a worker's: what it holds, what it runs)
            s = simulate(sc, fork=fork, brief=True).summary
    except ConfigError as exc:
        return {**row, **asked_degrees(data, plan.changes), "status": "refused",
                "reason": ": ".join(p for p in (exc.field, exc.message) if p)}
    split = step_split(s)
    mem = s["memory"]
    return {**row, "status": "ok", **{k: s[k] for k in FIGURES}, "compute_s": split["compute_s"],
            "exposed_comm_s": s["exposed_comm_s"], "bubble_s": split["bubble_s"], "peak_bytes": mem["peak_bytes"],
            "capacity_bytes": mem["capacity_bytes"], "fits": mem["fits"], "tight": mem["tight"],
            "host_fits": None if mem.get("host") is None else mem["host"]["fits"],
            "estimate": bool(s["simulation"]["asymmetric_orbits"]),
            # (a sweep of NIC rates goes flat where PCIe caps them: each table says which plans)
            "link_ceilings": s["hardware"]["link_ceilings"],
            # (a tie the table alone leaves unexplained: noop_lines)
            "recomputes_nothing": sc.cfg.training.recomputes_nothing}


@contextmanager
def _on_board(plan: int) -> Iterator[None]:
    """A worker simulates ``plan`` (``_BOARD``), until the block ends however it ends."""
    board = _BOARD
    if board is None:
        yield
        return
    board.mark(plan)
    try:
        yield
    finally:
        board.mark(0)


UNFIT_WHY = "weights, gradients, optimizer states and the activations the schedule holds alone exceed it"
HOST_UNFIT_WHY = ", or what the GPUs offload a node's host memory"  # (where some plan is left out so)


def unfit_reason(floor: dict[str, Any]) -> str:
    """Why a plan left out by its memory floor cannot fit, in a line (with the digits that
    tell the floor from the capacity: 80.04 GiB is not "80.0 GiB, more than 80.0")."""
    from .output.summary import GiB, host_only_unfit

    need, cap = floor["peak_bytes"] / GiB, floor["capacity_bytes"] / GiB
    if host_only_unfit(floor):  # (every GPU fits: the host's memory does not)
        host = floor["host"]
        return (f"needs {host['peak_bytes'] / GiB:,.1f} GiB of host memory on node {host['node']} for what it "
                f"offloads, more than its {host['capacity_bytes'] / GiB:,.1f} GiB")
    digits = 1
    while digits < 6 and f"{need:.{digits}f}" == f"{cap:.{digits}f}":
        digits += 1
    return (f"needs at least {need:.{digits}f} GiB a GPU (stage {floor['stage']}), more than the GPU's "
            f"{cap:.{digits}f} GiB")


def _given_varies(varies: Any) -> list[tuple[str, list[Any]]]:
    """run_sweep's ``varies`` from Python: (key, values) pairs or a dict of them, each key's
    values a list or tuple; TypeError otherwise (a bare value or a dict read as its keys
    failed deep inside before)."""
    pairs = list(varies.items()) if isinstance(varies, dict) else list(varies) if isinstance(varies, (list, tuple)) \
        else None
    if pairs is None or not all(isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str)
                                and isinstance(x[1], (list, tuple)) for x in pairs):
        raise TypeError("run_sweep's varies are (key, values) pairs or a dict of them, each key's values a list, "
                        f"e.g. [(\"parallel.tp\", [4, 8])], not {short_repr(varies)}")
    keys = repeats([k for k, _ in pairs])
    for key, values in pairs:  # (as the command line refuses them: a key twice, no value, a plan twice)
        twice = repeats(values)
        said = (f"{key} is varied twice; give its values in one list" if key in keys else
                f"{key} has no values" if not values else
                f"{key}: {short_repr(twice[0])} is given twice" if twice else "")
        if said:
            raise ConfigError(said, source="<python>", field="run_sweep's varies")
    return [(k, list(v)) for k, v in pairs]


def run_sweep(path: str, varies: list[tuple[str, list[Any]]], *, jobs: int = 1, progress=None,
              paired: bool = False, prune: bool = False) -> dict[str, Any]:
    """Simulate every plan of the sweep of ``path`` over ``varies`` (``paired``: the values
    taken together, see :func:`plans_of`; ``prune``: plans certain not to fit in memory are
    listed as such, not simulated); the sweep as sweep.json holds it: the file, the keys and
    values, whether they are paired, whether dp follows, whether it pruned, every plan's row
    in plan order and the ranking (plan numbers, best first). ``varies`` may also be a dict
    of them (key: its values)."""
    from .config import load_scenario

    varies = _given_varies(varies)
    data = read_yaml(Path(path), what="scenario")
    base = load_scenario(path)  # the file itself must be a valid scenario
    check_keys(path, data, varies)
    keys = [k for k, _ in varies]
    dp_follows = DP not in keys and any(k in keys for k in (*_MESH, "cluster.nodes", "cluster.node.gpus",
                                                              "cluster.topology"))
    # the file's split of the layers is for its own pipeline: other pp, vpp or schedules split evenly
    split_follows = value_at(data, SPLIT) is not None and SPLIT not in keys and any(k in keys for k in _PARTS)
    # interleaving needs model chunks, which the other schedules refuse: where the schedule is
    # varied and vpp not, each plan takes the chunks its schedule needs (as advise's do)
    chunks_follow = "parallel.schedule" in keys and "parallel.vpp" not in keys
    per_node = base.topology.node.gpus
    todo, rows = [], {}
    for plan in plans_of(varies, paired):
        if chunks_follow:
            plan = with_chunks(data, plan)
        if split_follows:
            plan = with_split(data, plan)
        if dp_follows:
            plan, why = with_dp(data, plan, per_node, base.mesh.world_size // per_node, Path(path).parent)
            if why is not None:
                # (no dp fills the GPUs: none is said)
                rows[plan.number] = {"plan": plan.number, "changes": dict(plan.changes),
                                     **asked_degrees(data, plan.changes), "dp": None, "status": "refused",
                                     "reason": why}
                continue
        todo.append(plan)
    simulate_plans(path, data, todo, rows, jobs=jobs, progress=progress, prune=prune)
    ordered = [rows[n] for n in sorted(rows)]
    return {"scenario": str(path), "vary": {k: v for k, v in varies}, "paired": paired, "dp_follows": dp_follows,
            "split_follows": split_follows, "chunks_follow": chunks_follow, "pruned": prune, "plans": ordered,
            "ranking": ranking(ordered)}


def with_chunks(data: dict[str, Any], plan: Plan) -> Plan:
    """``plan`` (which sets the schedule, not vpp) with the model chunks a rank its schedule
    needs: an interleaved plan 2 where the file has 1 (vpp's default; interleaving refuses
    it), a plan of another schedule 1 where the file interleaves (1F1B refuses vpp 2, and
    its vpp_group unless the plan sets one); else the file's."""
    changed = dict(plan.changes)
    schedule, vpp = changed.get("parallel.schedule"), value_at(data, "parallel.vpp") or 1
    if schedule == "interleaved" and vpp < 2:
        return Plan(plan.number, plan.changes + [("parallel.vpp", 2)])
    if schedule not in (None, "interleaved") and vpp > 1:
        group = [] if "parallel.vpp_group" in changed else [("parallel.vpp_group", None)]
        return Plan(plan.number, plan.changes + [("parallel.vpp", None)] + group)
    return plan


def simulate_plans(path: str, data: dict[str, Any], plans: list[Plan], rows: dict[int, dict[str, Any]], *,
                   jobs: int = 1, progress=None, prune: bool = False, keep: int | None = None) -> None:
    """Simulate ``plans`` (the file ``path``, read as ``data``, with each plan's changes), in
    ``jobs`` forked processes where more than one, adding each plan's row to ``rows`` (which
    may hold refused plans already) by its number. ``progress(done, total)`` after each.
    ``prune``: a plan certain not to fit is not simulated (:func:`simulate_plan`), but plan
    number ``keep`` (advise's own plan) always is."""
    from . import host_memory
    from .forking import pool_forks
    from .hardware.topology import reused_clusters

    total = len(plans) + len(rows)
    jobs = min(jobs, len(plans)) if pool_forks() else 1  # (Windows: one process)

    # (one process: each plan may fork the process that simulates its shorter step, as run does)
    todo = [(path, data, plan, jobs <= 1, prune and plan.number != keep) for plan in plans]
    with reused_clusters(), host_memory.shared(jobs) if jobs > 1 else nullcontext():
        if jobs > 1 and any(not any(k.startswith("cluster.") for k, _ in p.changes) for p in plans):
            _build_cluster(path, data)  # once, for the workers to inherit (where a plan keeps it)
        _simulate_all(todo, rows, total, jobs, progress)


def _build_cluster(path: str, data: dict[str, Any]) -> None:
    """Build the cluster of the file's own plan (``reused_clusters`` keeps it), if it loads."""
    from .hardware.topology import cluster_of
    from .overrides import load_variant

    try:
        cluster_of(load_variant(path, [], data).topology)
    except ConfigError:
        pass  # (its plans say why)


# how often the sweep's process looks for a worker that ended without its plan's row
LOST_POLL_S = 1.0
# rounds of workers in a row that end (killed) with no plan's row: the plans left fail
LOST_ROUNDS = 3
KILLED_WHY = ("its worker process ended while simulating it, killed (by the system's out-of-memory killer, most "
              "likely); simulate it alone with clustersim run, or with fewer --jobs")
KEPT_DYING_WHY = "its worker processes kept ending (killed) before any plan's row came back"


# each worker of the pool now running and the plan it simulates (0: none), from its start
# (forking.WorkerSlots): ``multiprocessing.Pool`` waits for ever for the row of a plan whose
# worker was killed (the out-of-memory killer); the sweep's process reads here that a worker
# has gone and whose plan it took with it. None: no pool
_BOARD: WorkerSlots | None = None


def _simulate_all(todo: list, rows: dict[int, dict[str, Any]], total: int, jobs: int, progress) -> None:
    """:func:`simulate_plans`' jobs, in ``jobs`` forked processes where more than one
    (:func:`_simulate_jobs`), each plan's cyclic garbage collected where the collector is off
    (:func:`_collected_row`)."""

    def add(new: list[dict[str, Any]]) -> None:
        rows.update((row["plan"], row) for row in new)
        if progress is not None and new:
            progress(len(rows), total)

    frozen = not gc.isenabled()
    if frozen:
        # the objects made so far (the imports, the cluster) are kept through the plans: the
        # collections after each plan (_collected_row) skip them, and workers forked from here
        # leave their pages unwritten; given back to the collector afterwards (a library's
        # caller, whose objects they are)
        gc.freeze()
    try:
        _simulate_jobs(todo, rows, add, jobs)
    finally:
        if frozen:
            gc.unfreeze()


def _simulate_jobs(todo: list, rows: dict[int, dict[str, Any]], add, jobs: int) -> None:
    """:func:`_simulate_all`'s plans, each row given to ``add`` (which puts it in ``rows``) as it
    comes. Where a worker is killed, the plan it was simulating gets a ``failed`` row, and the
    pool is stopped and made again for the plans with no row yet (those then on the other
    workers run again)::

        round:  pool ─ rows come back ─ a worker gone? ─ its plan failed ─ stop ─ next round
        LOST_ROUNDS rounds in a row without a row (workers killed between plans): the rest fail
    """
    global _BOARD

    if jobs <= 1:
        for row in map(_collected_row, todo):
            add([row])
        return
    idle = 0
    while todo:
        _BOARD = WorkerSlots(2 * jobs)  # (room for a replaced worker beside the one it replaces)
        pool = multiprocessing.get_context("fork").Pool(jobs, initializer=_worker_start)
        before = len(rows)
        done = False
        try:
            got = pool.imap_unordered(_collected_row, todo)
            for _ in range(len(todo)):
                row = _next_row(got, _BOARD)
                if isinstance(row, list):  # (the plans of the workers gone)
                    add([_failed(todo, n, KILLED_WHY) for n in row])
                    break
                add([row])
            else:
                done = True
        finally:
            _BOARD = None
            if done:
                pool.close()
            else:  # a worker gone, an error or an interrupt: the plans left run again or are not wanted
                pool.terminate()
            pool.join()
        idle = 0 if len(rows) > before else idle + 1
        todo = [j for j in todo if j[2].number not in rows]
        if idle >= LOST_ROUNDS:
            add([_failed(todo, j[2].number, KEPT_DYING_WHY) for j in todo])
            todo = []


def _collected_row(job: tuple) -> dict[str, Any]:
    """:func:`simulate_plan`, then, where the cyclic garbage collector is off (``python -m
    clustersim``: one command, one short-lived process), a collection of what the plan left in
    cycles (a refusal's traceback, the scenario's models): a sweep runs thousands of plans in
    one process, and they held 750 MB after 1,536 plans of Llama-2 70B (2 ms a plan with the
    objects from before the plans frozen, :func:`_simulate_all`)."""
    row = simulate_plan(job)
    if not gc.isenabled():
        gc.collect()
    return row


def _next_row(got, board: WorkerSlots) -> dict[str, Any] | list[int]:
    """The next row ``got`` gives; or, where a worker has ended first, the plans the ended
    workers were simulating (none where one ended between plans: the plan it had taken, if
    any, is unknown)."""
    while True:
        try:
            return got.next(timeout=LOST_POLL_S)
        except multiprocessing.TimeoutError:
            with board.lock:
                gone = board.reap()
            if gone:
                return [n for n in gone if n]


def _failed(todo: list, plan: int, why: str) -> dict[str, Any]:
    """The row of ``plan`` (a job of ``todo``) ended without a result, ``why``."""
    job = next(j for j in todo if j[2].number == plan)
    return {"plan": plan, "changes": dict(job[2].changes), **asked_degrees(job[1], job[2].changes),
            "status": "failed", "reason": why}


def check_keys(path: str, data: dict[str, Any], varies: list[tuple[str, list[Any]]]) -> None:
    """Refuse, before any plan runs, a varied key the scenario format does not have, one that
    runs through a value (a misspelt field would have every plan refused for it), and a value
    the key's field never takes (``parallel.tp=x``, ``parallel.schedule=gpipee``, ``parallel.pp=0``:
    its type, range or choices): the file with each value alone must not be refused for
    that. A value refused by a rule between fields (``tp=3`` against 64 heads) is the plan's.

    An unknown key is said as ``run --set`` says it (the scenario's check, with the nearest
    field), naming ``--vary`` and the key; under a section the format does not have
    (``modelx.a``) the check names the section, so the section is said too::

        command line: --vary modelx.a: modelx: unknown key (did you mean 'model'? see docs/reference.md)

    A value holding a key its field does not have (``cluster.what_if=[{gpu: 1, slowdon: 2}]``)
    is refused as the check says it."""
    from .overrides import load_variant

    for key, values in varies:
        for value in values:
            try:
                load_variant(path, [(key, value)], data)
            except ConfigError as exc:
                # (the check names the first part of the key it does not know: the key itself, or a
                # section above it, which no plan's other changes can make known)
                if exc.message.startswith("unknown key") and exc.field and (
                        key == exc.field or key.startswith(f"{exc.field}.")):
                    said = exc.message if exc.field == key else f"{exc.field}: {exc.message}"
                    raise ConfigError(said, source="command line", field=f"--vary {key}") from None
                if exc.field == key and (exc.bad_value or "not a section with keys" in exc.message):
                    raise
                if exc.message.startswith("unknown key") and exc.field and exc.field.startswith((f"{key}.", f"{key}[")):
                    raise  # a key inside the value given (cluster.what_if=[{gpu: 1, slowdon: 2}]): no plan takes it
            # (any other refusal is the plan's: listed with its rule)


def _worker_start() -> None:
    """A worker leaves Ctrl-C to the sweep's process (which stops the pool) and ends on SIGTERM
    as a process does by default, not by the command line's handler (which would print a
    traceback from every worker the pool stops); it is on ``_BOARD`` from its start, so that
    its end is seen even before its first plan."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _BOARD is not None:
        _BOARD.mark(0)


def ranking(rows: list[dict[str, Any]]) -> list[int]:
    """Plan numbers of the simulated plans, best first: those that fit by tokens/s, then those
    that do not by tokens/s (what they would give if they fit); a tie keeps the plan order."""
    done = [r for r in rows if r["status"] == "ok"]
    return [r["plan"] for r in sorted(done, key=lambda r: (not r["fits"], -r["tokens_per_s"], r["plan"]))]


def column_heads(keys: list[str]) -> list[str]:
    """Column heads for the varied keys: the last part of each key where that is unique."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return [s if last.count(s) == 1 else k for s, k in zip(last, keys)]


def cell_text(v: Any) -> str:
    if isinstance(v, (list, dict)):
        return yaml.safe_dump(v, default_flow_style=True, width=10**6).strip()
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _columns(sweep: dict[str, Any]) -> list[str]:
    """The keys a plan is shown by: those varied, then dp where it follows them (never varied
    then: run_sweep, run_advise)."""
    return list(sweep["vary"]) + ([DP] if sweep["dp_follows"] else [])


def format_sweep(sweep: dict[str, Any], top: int = 20) -> str:
    """The terminal's table: the ``top`` best plans, then how many more, then those refused."""
    n = len(sweep["plans"])
    how = (" with ".join(sweep["vary"]) + ", value by value" if sweep.get("paired") else
           " x ".join(f"{k} ({len(v)})" for k, v in sweep["vary"].items()))
    lines = [f"clustersim · sweep {sweep['scenario']}: {n:,} plan{'s' if n != 1 else ''} ({how})"
             + ("; dp follows: GPUs / (tp x pp x cp)" if sweep["dp_follows"] else "")
             + ("; the layers split evenly where pp or the schedule is not the file's"
                if sweep.get("split_follows") else "")
             + ("; interleaved plans take the file's vpp, or 2 model chunks a rank, the others 1"
                if sweep.get("chunks_follow") else ""),
             "best first: the plans that fit by tokens/s, then those that do not (the step they would take)"]
    return "\n".join(lines + table_lines(sweep, top))


def plan_text(sweep: dict[str, Any], row: dict[str, Any]) -> str:
    """A plan's keys as the table shows them: ``tp=4 pp=8 recompute=selective dp=2``."""
    keys = _columns(sweep)
    return " ".join(f"{h}={cell_text(row['changes'].get(k))}" for h, k in zip(column_heads(keys), keys)
                    if k in row["changes"])


def also_set(sweep: dict[str, Any], r: dict[str, Any]) -> str:
    """The plan's changes besides the keys it is shown by (an advice sets what each plan needs:
    ``parallel.sp=true`` with TP, say), as the command line gives them; "" where none."""
    shown = set(_columns(sweep))
    return changes_text([(k, v) for k, v in r["changes"].items() if k not in shown and v is not None])


def step_text(r: dict[str, Any], marked: bool) -> str:
    """A plan's step as the tables show it: followed by :data:`ESTIMATE_MARK` where it is an
    estimate, by :data:`NO_MARK` where it is not, both only where some row shown is
    (``marked``)."""
    mark = (ESTIMATE_MARK if r.get("estimate") else NO_MARK) if marked else ""
    return f"{r['step_time_s']:.3f}{mark}"


def table_columns(sweep: dict[str, Any], shown: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The ranked table's columns for the rows ``shown``, each (head, a simulated plan's row ->
    its cell): the plan's number, the keys it is shown by (:func:`_columns`), then its
    figures, the step marked where it is an estimate (:func:`step_text`), the tokens/s of
    all its GPUs where the rows shown differ in GPU count (what they are ranked by)."""
    from .output.summary import GiB

    keys = _columns(sweep)
    marked = any(r.get("estimate") for r in shown)
    # where the plans run on different GPU counts, the tokens/s they are ranked by are shown
    # too: per GPU alone, the ranking would read out of order
    worlds = {round(r["tokens_per_s"] / r["tokens_per_s_per_gpu"]) for r in shown if r["tokens_per_s_per_gpu"]}
    total = [("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}")] if len(worlds) > 1 else []
    return [("#", lambda r: str(r["plan"]))] + [
        (h, lambda r, k=k: cell_text(r["changes"].get(k))) for h, k in zip(column_heads(keys), keys)] + [
        ("step s", lambda r: step_text(r, marked))] + total + [
        ("tokens/s/GPU", lambda r: f"{r['tokens_per_s_per_gpu']:,.1f}"),
        ("MFU", lambda r: f"{100 * r['mfu']:.1f} %"),
        ("bubble", lambda r: f"{100 * r['bubble_fraction']:.1f} %"),
        ("exposed s", lambda r: f"{r['exposed_comm_s']['total']:.3f}"),
        ("peak GiB", lambda r: f"{r['peak_bytes'] / GiB:.1f}"),
        ("fits", fits_text)]


def fits_text(r: dict[str, Any]) -> str:
    """A plan's "fits" cell: yes, tight, NO, or "NO: host" where its GPUs fit and the hosts'
    memory does not hold what it offloads."""
    from .output.summary import host_only_unfit

    if r["fits"]:
        return "tight" if r.get("tight") else "yes"
    host = None if r.get("host_fits") is None else {"fits": r["host_fits"]}
    return "NO: host" if host_only_unfit({**r, "host": host}) else "NO"


def estimate_legend(shown: list[dict[str, Any]]) -> list[str]:
    """What :data:`ESTIMATE_MARK` after a step means, in two lines, where one of the rows
    ``shown`` has it (none where none does)."""
    from .config import MAX_GPUS_ALL_RANKS
    from .output.summary import ESTIMATE_SPREAD, SLOWEST_TWIN

    if not any(r.get("estimate") for r in shown):
        return []
    return [f"{ESTIMATE_MARK} an estimated step, {SLOWEST_TWIN}:",
            f"  {ESTIMATE_SPREAD}; run --all-ranks checks one (up to {MAX_GPUS_ALL_RANKS:,} GPUs)"]


def ceiling_lines(plans: list[dict[str, Any]]) -> list[str]:
    """The links that cap the NICs of some simulated ``plans`` below their rate (each row's
    ``link_ceilings``, the summary's ``hardware.link_ceilings``), each with the plans it caps:
    a sweep of NIC rates goes flat where PCIe caps them, and the table alone does not say why.
    [] where none is::

        PCIe at 64 GB/s caps the NICs' 90/180 GB/s between nodes on #3, #4; node.pcie_GBps raises it"""
    from .output.summary import link_ceiling_said

    by: dict[tuple, list[tuple[int, dict]]] = {}
    for r in plans:
        for c in r.get("link_ceilings") or ():
            by.setdefault((c["link"], c["bw_GBps"]), []).append((r["plan"], c))
    out = []
    for (link, bw), got in by.items():
        named = ", ".join(f"#{n}" for n, _ in got[:6]) + (f" and {len(got) - 6:,} more" if len(got) > 6 else "")
        if link == "pcie":
            rates = "/".join(f"{x:.3g}" for x in sorted({c["nic_GBps"] for _, c in got}))
            out.append(f"PCIe at {bw:.3g} GB/s caps the NICs' {rates} GB/s between nodes on {named}; "
                       "node.pcie_GBps raises it")
        else:
            out.append(f"{link_ceiling_said(got[0][1])} (on {named})")
    return out


def noop_lines(plans: list[dict[str, Any]]) -> list[str]:
    """The ``plans`` whose own changes make a selective recompute that recomputes nothing
    (flash attention keeps no scores for Megatron's default module, core_attn, to recompute):
    each ties with the plan without recompute, and a reader of the table may take it for a
    plan that saves memory. [] where none is::

        recompute=selective recomputes nothing under flash attention (#2): the plan without recompute"""
    keys = ("training.recompute", "training.recompute_modules", "training.attention")
    got = sorted(r["plan"] for r in plans if r.get("recomputes_nothing") and any(k in r["changes"] for k in keys))
    if not got:
        return []
    named = ", ".join(f"#{n}" for n in got[:6]) + (f" and {len(got) - 6:,} more" if len(got) > 6 else "")
    return [f"recompute=selective recomputes nothing under flash attention ({named}): flash keeps no scores "
            f"for core_attn to recompute, so {'it is' if len(got) == 1 else 'each is'} the plan without recompute"]


def upper_bound_line() -> str:
    """What the figures are against a real run, as ``run``'s MFU line says it: what the
    simulation leaves out (kernel launches, no framework overhead) makes
    every step short and every MFU and tokens/s high, by about the same share between plans."""
    from .output.summary import published_longer

    return f"steps are lower bounds, tokens/s and MFU upper ones: {published_longer()} (docs/metrics.md)"


def tight_lines(rows: dict[int, dict[str, Any]], ranked: list[int], shown: list[dict[str, Any]]) -> list[str]:
    """What "tight" in the fits column means, where a row ``shown`` is (none where none is), and,
    where the best plan that fits is tight, the first that fits with room and how many fewer
    tokens/s it gives: a plan with less than TIGHT_SHARE of the GPU's memory spare may not fit
    once what the model leaves out is counted (analysis.memory)."""
    from .analysis.memory import TIGHT_SHARE
    from .output.summary import GiB

    tight = [r for r in shown if r.get("fits") and r.get("tight")]
    if not tight:
        return []
    below = TIGHT_SHARE * tight[0]["capacity_bytes"] / GiB
    lines = [f"tight: fits with less than {below:.1f} GiB spare ({100 * TIGHT_SHARE:g} % of the GPU), which the CUDA "
             "context, NCCL's buffers and the allocator's fragmentation, not modelled, can take"]
    fit = [rows[n] for n in ranked if rows[n]["fits"]]
    if fit and fit[0].get("tight"):
        room = next((r for r in fit if not r.get("tight")), None)
        lines.append(f"  the best that fits, #{fit[0]['plan']}, is tight; " + (
            f"the best with room, #{room['plan']}, gives {100 * (1 - room['tokens_per_s'] / fit[0]['tokens_per_s']):.1f} "
            "% fewer tokens/s" if room is not None else "none that fits has room"))
    return lines


def table_lines(sweep: dict[str, Any], top: int, notes: dict[int, str] | None = None, note_head: str = "",
                files: str = "sweep.csv with --out", refused_shown: int | None = None) -> list[str]:
    """The ranked plans' table (the varied keys, then the figures; ``notes`` a last column by
    plan number), how many more were simulated, the plans refused with their rule, and those
    whose worker process was killed."""
    rows = {r["plan"]: r for r in sweep["plans"]}
    n, done = len(rows), len(sweep["ranking"])
    refused = [r for r in sweep["plans"] if r["status"] == "refused"]
    unfit = [r for r in sweep["plans"] if r["status"] == "unfit"]
    failed = [r for r in sweep["plans"] if r["status"] == "failed"]
    shown = [rows[p] for p in sweep["ranking"][:top]]
    cols = table_columns(sweep, shown)
    lines = []
    if shown:
        table = [[h for h, _ in cols]] + [[f(r) for _, f in cols] for r in shown]
        widths = [max(len(t[j]) for t in table) for j in range(len(cols))]
        for t, r in zip(table, [None, *shown]):
            note = (note_head if r is None else (notes or {}).get(r["plan"], "")) if notes is not None else ""
            lines.append(("  ".join(c.rjust(w) for c, w in zip(t, widths)) + "  " + note).rstrip())
        lines += estimate_legend(shown) + [upper_bound_line()] + tight_lines(rows, sweep["ranking"], shown)
        lines += ceiling_lines([rows[p] for p in sweep["ranking"]]) + noop_lines([rows[p] for p in sweep["ranking"]])
    if done > len(shown):
        lines.append(f"... and {done - len(shown):,} more simulated (--top, or {files})")
    if not done:
        lines.append(("none fits in memory: every plan is certain not to fit" if not refused else
                      "no plan simulated: each is certain not to fit or refused") if unfit else
                     "no plan could be simulated")
    elif not rows[sweep["ranking"][0]]["fits"]:
        lines.append("none fits in memory: each step is what it would take if it did")
    shown_n = top if refused_shown is None else refused_shown
    hosts = any("of host memory" in r["reason"] for r in unfit)  # (unfit_reason's host wording)
    for left, head, why in ((unfit, "certain not to fit in memory, not simulated", UNFIT_WHY + (HOST_UNFIT_WHY if hosts
                                                                                               else "")),
                            (refused, "refused by the scenario's rules", ""),
                            (failed, "ended without a result", "")):
        if not left:
            continue
        lines.append(f"{head}: {len(left):,} of {n:,}" + (f" ({why})" if why else ""))
        for r in left[:shown_n]:  # (its number, as the table's and the files')
            lines.append(f"  #{r['plan']} {plan_text(sweep, r)}: {r['reason']}")
        if len(left) > shown_n:
            lines.append(f"  ... and {len(left) - shown_n:,} more ({files.replace('.csv', '.json')})")
    return lines


def sweep_csv(sweep: dict[str, Any]) -> str:
    """sweep.csv: a line per plan in plan order, the varied keys' values, the plan's dp and vpp
    where not varied (:func:`csv_keys`), then the figures; a cell that does not apply is
    empty, as a refused plan's figures are."""
    import csv
    import io

    keys = csv_keys(sweep)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([CSV_COLUMNS[0], *keys, *CSV_COLUMNS[1:]])
    for r in sweep["plans"]:
        vals = {**r, "exposed_comm_s": r["exposed_comm_s"]["total"] if "exposed_comm_s" in r else ""}
        w.writerow([r["plan"], *(_key_cell(sweep, r, k) for k in keys),
                    *(vals.get(c, "") for c in CSV_COLUMNS[1:])])
    return buf.getvalue()


# the plan's degrees every line of the CSV has, varied or not: dp (which follows the others or
# is the file's) and vpp (an interleaved plan's virtual stages, which its schedule may set)
_CSV_DEGREES = {DP: "dp", VPP: "vpp"}


def csv_keys(sweep: dict[str, Any]) -> list[str]:
    """The CSV's key columns: the varied keys, then dp and vpp where not among them."""
    keys = list(sweep["vary"])
    return keys + [k for k in _CSV_DEGREES if k not in keys]


def _key_cell(sweep: dict[str, Any], r: dict[str, Any], key: str) -> str:
    """A plan's cell of the key column ``key``: a varied key's value as given; dp and vpp not
    varied, the plan's own (the row's ``dp`` and ``vpp``; a row without them, of a sweep.json
    from before, its change where it has one), empty where it has none (a plan whose degrees
    do not divide the GPUs has no dp; a plan that does not interleave, no vpp)."""
    if key in sweep["vary"]:
        return cell_text(r["changes"].get(key))
    v = r[_CSV_DEGREES[key]] if _CSV_DEGREES[key] in r else r["changes"].get(key)
    return "" if v is None else cell_text(v)
