"""Action templates (lowering) and segments (engine): the same program and the same spans.

The lowering makes an action that a rank repeats from an ActionTemplate after its first time;
the engine times each such run of fixed-duration tasks as one segment; the analysis reads the
tasks of the runs off their templates. All three are shortcuts, so each is checked against the
long way: the tasks of every action made by ``_blocks``, the stream loop timing every task, and
the task columns read task by task, on every shipped scenario and on variants of the small one.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

import clustersim
from clustersim import codegen
from clustersim.api import with_microbatches
from clustersim.analysis.columns import TaskColumns
from clustersim.engine import Engine
from clustersim.engine import sim as engine_sim
from clustersim.hardware.topology import TopologyCfg, build_cluster
from clustersim.program.lower import lower
from clustersim.program.tasks import Comm, Program
from clustersim.trace import Span

from .conftest import ROOT, scenario_dict, shipped_scenarios

def _rows(trace) -> list[tuple]:
    """Every field of every span, in trace order."""
    return list(map(Span.values, trace.spans))


SHIPPED = [p.name for p in shipped_scenarios()]
VARIANTS = {
    "tp-sp-zero2": dict(parallel={"tp": 4, "pp": 2, "dp": 2, "sp": True, "zero": 2}),
    "interleaved-recompute": dict(parallel={"tp": 2, "pp": 2, "dp": 4, "schedule": "interleaved", "vpp": 2},
                                  training={"recompute": "full"}),
    "straggler": dict(cluster={"topology": "topologies/dgx-a100.yaml", "nodes": 2,
                               "what_if": [{"gpu": 3, "slowdown": 1.4}]}),
    "zb-h1": dict(parallel={"tp": 2, "pp": 4, "dp": 2, "schedule": "zb-h1"}),
    # the parameters gathered in each part's first forward only: those actions made by _blocks
    "interleaved-zero1-overlap-gather": dict(parallel={"tp": 2, "pp": 2, "dp": 4, "schedule": "interleaved", "vpp": 2,
                                                       "zero": 1, "overlap_param_gather": True}),
    "moe-ep": dict(model={"name": "tiny-moe", "layers": 4, "hidden": 1024, "heads": 8, "vocab": 32000,
                          "seq_len": 512, "moe": {"experts": 8, "top_k": 2, "expert_ffn": 1024}},
                   parallel={"tp": 2, "pp": 2, "dp": 4, "ep": 4, "sp": True}),
    # ZeRO-2's reductions made after each W, dense and expert, and waited for by the next action
    "moe-zb-zero2": dict(model={"name": "tiny-moe", "layers": 4, "hidden": 1024, "heads": 8, "vocab": 32000,
                                "seq_len": 512, "moe": {"experts": 8, "top_k": 2, "expert_ffn": 1024}},
                         parallel={"tp": 2, "pp": 2, "dp": 4, "ep": 2, "sp": True, "zero": 2, "schedule": "zb-h1"},
                         training={"global_batch_size": 32}),
    # offload copies among an action's tasks, which are not its compute (the buckets' inputs)
    "activation-offload": dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 1},
                               parallel={"tp": 2, "pp": 1, "dp": 4, "zero": 1, "overlap_grad_reduce": True},
                               training={"global_batch_size": 16, "activation_offload_layers": 2}),
    # the receiver's gather of a scattered PP send, made where its action is
    "pp-scatter-gather": dict(parallel={"tp": 4, "pp": 2, "dp": 2, "pp_scatter_gather": True}),
}


MAX_MICROBATCHES = 64  # past its warm-up a long step repeats the same actions: gpt3_175b's 192 cost 30 s more


def _scenario(name: str) -> clustersim.Scenario:
    if name in VARIANTS:
        return clustersim.load_scenario(scenario_dict(**VARIANTS[name]), base_dir=ROOT)
    sc = clustersim.load_scenario(ROOT / "scenarios" / name)
    return sc if sc.microbatches <= MAX_MICROBATCHES else with_microbatches(sc, MAX_MICROBATCHES)


def _task_rows(prog: Program | list) -> list[tuple]:
    """Every field of each task (of a program, or of a list of tasks), its communication's too."""
    rows = []
    for t in prog.tasks if isinstance(prog, Program) else prog:
        c = t.comm
        rows.append((t.tid, t.rank, t.stream, t.name, t.kind, t.duration_s, t.deps, t.mb, t.phase, t.stage,
                     t.layer, t.flops, t.model_flops, t.size_bytes,
                     None if c is None else (c.op, c.size_bytes, c.group, c.twins, c.members, c.key, c.recv_rank,
                                             c.load)))
    return rows


@contextmanager
def _written_out():
    """Templates written out as functions from their first use (clustersim.codegen), however
    few times a scenario uses them; compiled afresh."""
    kept, after, look = dict(codegen._STRUCTURES), codegen.COMPILE_AFTER, codegen.LOOK_AFTER
    codegen._STRUCTURES.clear()
    codegen.COMPILE_AFTER = codegen.LOOK_AFTER = 1
    try:
        yield
    finally:
        codegen.COMPILE_AFTER, codegen.LOOK_AFTER = after, look
        codegen._STRUCTURES.clear()
        codegen._STRUCTURES.update(kept)


def _written(prog: Program) -> int:
    """How many of ``prog``'s templates have their written-out function."""
    templates = {id(tmpl): tmpl for _, _, _, tmpl in prog.runs}.values()
    return sum(tmpl.straight is not None and tmpl.straight.fn is not None for tmpl in templates)


@pytest.mark.parametrize("name", SHIPPED + sorted(VARIANTS))
def test_templates_make_the_tasks_blocks_makes(name):
    """By the loop over a template's protos and by its written-out function."""
    sc = _scenario(name)
    made, _ = lower(sc)
    slow, _ = lower(sc, templates=False)
    assert not slow.runs
    assert _task_rows(made) == _task_rows(slow)
    for rank, first, end, tmpl in made.runs:  # a run is its template's tasks, on its rank
        assert end - first == len(tmpl)
        assert {t.rank for t in made.tasks[first:end]} == {rank}
        assert [t.name for t in made.tasks[first:end]] == [p[2] for p in tmpl.protos]
    with _written_out():
        written, _ = lower(sc)
    assert _task_rows(written) == _task_rows(slow)
    # not vacuous: every template wrote its function (when it was checked, on its first use)
    assert _written(written) == len({id(r[3]) for r in written.runs})


@pytest.mark.parametrize("name", SHIPPED + sorted(VARIANTS))
def test_task_columns_read_off_templates_are_those_of_the_tasks(name):
    """TaskColumns with the program's runs (each run's tasks from its template's protos, its
    inputs from the tasks that read them) against the same columns read task by task."""
    prog, _ = lower(_scenario(name))
    fast, slow = TaskColumns(prog.tasks, prog.runs), TaskColumns(prog.tasks)
    for col in ("rank", "stream", "n_members", "recv_rank", "prev", "rendezvous"):
        a, b = getattr(fast, col), getattr(slow, col)
        assert a.dtype == b.dtype and np.array_equal(a, b), col
    assert fast.stream_names == slow.stream_names
    assert all(np.array_equal(a, b) for a, b in zip(fast.deps, slow.deps))
    # not vacuous: the tasks of the runs are not read one by one
    assert len(fast._layout.gap) == len(prog.tasks) - sum(e - f for _, f, e, _ in prog.runs)


@pytest.mark.parametrize("name", SHIPPED + sorted(VARIANTS))
def test_runs_left_to_be_made_read_as_the_made_tasks(name):
    """The lowering leaves most runs' tasks to be made on first ask (Program.deferred): the
    task columns read such runs off their templates and inputs, the engine times them, and a
    task asked for is the one the run would have made; none of it makes the other runs."""
    sc = _scenario(name)
    lazy, _ = lower(sc)
    made, _ = lower(sc)
    all_tasks = made.tasks  # every run made
    if len(lazy.runs) > len({(r[0], id(r[3])) for r in lazy.runs}):  # a template used again
        assert lazy.deferred and None in lazy.items  # not vacuous
    left = dict(lazy.deferred)
    fast, slow = TaskColumns(lazy.items, lazy.runs, lazy), TaskColumns(all_tasks)
    for col in ("rank", "stream", "n_members", "recv_rank", "prev", "rendezvous"):
        a, b = getattr(fast, col), getattr(slow, col)
        assert a.dtype == b.dtype and np.array_equal(a, b), col
    assert all(np.array_equal(a, b) for a, b in zip(fast.deps, slow.deps))
    if not (slow.n_members >= 2).any():  # (a rendezvous of several members reads its tasks)
        assert lazy.deferred == left  # the columns made no run
    a, b = _run(sc, lazy)[1], _run(sc, made)[1]
    assert [s.values() for s in a.spans] == [s.values() for s in b.spans]
    for k in list(lazy.deferred)[:5]:  # a task asked for: its run made, as the lowering makes it
        first, end = lazy.runs[k][1:3]
        assert _task_rows([lazy.task(end - 1)]) == _task_rows([all_tasks[end - 1]])
        assert k not in lazy.deferred and _task_rows(lazy.items[first:end]) == _task_rows(all_tasks[first:end])
    assert _task_rows(lazy) == _task_rows(made)


def test_repeated_actions_are_templated():
    """Not vacuous: a dense step makes most of its tasks from templates, ZeRO-3 none."""
    prog, _ = lower(_scenario("llama2_70b_64gpu.yaml"))
    assert sum(e - f for _, f, e, _ in prog.runs) > 0.9 * len(prog.tasks)
    prog, _ = lower(_scenario("zero3_llama3_8b_16gpu.yaml"))
    assert not prog.runs


def test_gathers_of_scattered_sends_are_in_their_actions_runs():
    """A receiver's gather of a scattered PP send is the first task of its action's run, made
    by the template as the action's blocks are (the engine times it in the run's segment), not
    a task of its own beside every run: Megatron-1T makes 64,512 of them."""
    prog, _ = lower(_scenario("pp-scatter-gather"))
    in_runs = {tid for _, first, end, _ in prog.runs for tid in range(first, end)}
    gathers = [t.tid for t in prog.tasks if t.name in ("F AG act", "B AG grad")]
    assert gathers and all(g in in_runs for g in gathers)
    firsts = {first for _, first, _, _ in prog.runs}
    assert all(g in firsts for g in gathers)


def _run(sc: clustersim.Scenario, prog: Program):
    sim = sc.cfg.simulation
    eng = Engine(prog, sc.cluster, sim.network, sim.collectives.model_dump())
    trace = eng.run()
    return eng, trace


def _segment_share(eng: Engine) -> float:
    lists = engine_sim._segmented(eng)
    n = sum(e.end - e.first for entries in lists.values() for e in entries if e.comm is engine_sim._SEGMENT)
    return n / len(eng.prog.tasks)


@pytest.mark.parametrize("name", SHIPPED + sorted(VARIANTS))
def test_segments_time_every_task_as_the_stream_loop(name):
    """Spans (every field, in trace order), link use and algorithms are bit for bit those of
    the stream loop timing each task (the same program without its runs)."""
    sc = _scenario(name)
    prog, _ = lower(sc)
    eng, fast = _run(sc, prog)
    plain, _ = lower(sc, templates=False)
    _, slow = _run(sc, plain)
    assert _rows(fast) == _rows(slow)
    assert fast.links == slow.links
    assert fast.algorithms == slow.algorithms
    with _written_out():  # each segment by its template's written-out function
        _, written = _run(sc, lower(sc)[0])
        segment_code = sum(kind == "segment" and st.make is not None for (kind, _), st in codegen._STRUCTURES.items())
    assert (segment_code > 0) == (_segment_share(eng) > 0)  # not vacuous
    assert _rows(written) == _rows(slow)
    assert written.links == slow.links


def test_dense_steps_run_mostly_in_segments():
    sc = _scenario("llama2_70b_64gpu.yaml")
    prog, _ = lower(sc)
    sim = sc.cfg.simulation
    assert _segment_share(Engine(prog, sc.cluster, sim.network, sim.collectives.model_dump())) > 0.8


def _node(gpus: int):
    cfg = TopologyCfg.model_validate({"gpu": "A100-SXM4-80GB", "nodes": 1,
                                      "node": {"gpus": gpus, "nvlink": {"bw_GBps": 100, "efficiency": 1.0,
                                                                        "latency_us": 0.0}},
                                      "fabric": {"kind": "none"}})
    return build_cluster(cfg)


def _late_input_program() -> tuple[Program, dict[str, int]]:
    """Rank 0: compute c0; then a run [c1, c2] where c2 also waits for ``a``, an all-reduce
    the flow network times (``b`` shares its links: its end is known on the clock only);
    ``x``, timed in the flow network too, waits for c1 alone. Within the run only c2 reads
    ``a``, so c1's end is known at once, and ``x`` must start then, not when ``a`` ends."""
    prog = Program(ranks=[0], weight={0: 4})
    group = (0, 1, 2, 3)
    size = 400e6  # 1.5 ms alone at 100 GB/s per link (ring); shared, longer
    a = prog.add(rank=0, stream="s1", name="a", kind="tp",
                 comm=Comm("all_reduce", size, group, (), (0,), ("x", 1, 0)))
    prog.add(rank=0, stream="s2", name="b", kind="dp", comm=Comm("all_reduce", size, group, (), (0,), ("y", 1, 0)))
    c0 = prog.add(rank=0, stream="compute", name="c0", kind="compute", duration_s=1e-4)
    first = len(prog.tasks)
    c1 = prog.add(rank=0, stream="compute", name="c1", kind="compute", duration_s=1e-4, deps=(c0.tid,))
    c2 = prog.add(rank=0, stream="compute", name="c2", kind="compute", duration_s=1e-4, deps=(c1.tid, a.tid))
    prog.runs.append((0, first, len(prog.tasks), object()))
    x = prog.add(rank=0, stream="s3", name="x", kind="dp", deps=(c1.tid,),
                 comm=Comm("all_reduce", 1e6, group, (), (0,), ("z", 1, 0)))
    return prog, {"a": a.tid, "c1": c1.tid, "c2": c2.tid, "x": x.tid}


@pytest.mark.parametrize("written", [False, True])
def test_a_segment_stops_for_a_late_input_and_keeps_earlier_ends_on_time(written):
    """Also where the template has its written-out function: it is for inputs all known."""
    cl = _node(4)
    prog, tid = _late_input_program()
    eng = Engine(prog, cl, "flow", {"all_reduce": "ring"})
    assert _segment_share(eng) == pytest.approx(2 / len(prog.tasks))  # the run is one segment
    if written:
        with _written_out():
            fast = eng.run()
    else:
        fast = eng.run()
    prog.runs.clear()
    slow = Engine(prog, cl, "flow", {"all_reduce": "ring"}).run()
    assert _rows(fast) == _rows(slow)
    span = {s.name: s for s in fast.spans}
    assert span["x"].start_s == pytest.approx(span["c1"].end_s, abs=1e-15)  # not held back by a
    assert span["a"].end_s > span["x"].start_s
    assert span["c2"].start_s == span["a"].end_s  # c2 waited for a


def test_runs_that_cannot_be_segments_are_left_to_the_stream_loop():
    """A run whose second task does not wait for its first (two independent streams), or
    which holds a communication the flow network times, is no segment."""
    cl = _node(4)
    group = (0, 1, 2, 3)
    prog = Program(ranks=[0], weight={0: 4})
    prog.add(rank=0, stream="compute", name="c0", kind="compute", duration_s=1e-4)
    prog.add(rank=0, stream="other", name="o0", kind="compute", duration_s=1e-4)
    first = len(prog.tasks)
    prog.add(rank=0, stream="compute", name="c1", kind="compute", duration_s=1e-4)
    prog.add(rank=0, stream="other", name="o1", kind="compute", duration_s=1e-4)
    prog.runs.append((0, first, len(prog.tasks), object()))
    first = len(prog.tasks)
    prog.add(rank=0, stream="compute", name="c2", kind="compute", duration_s=1e-4)
    prog.add(rank=0, stream="s1", name="a", kind="tp", deps=(first,),
             comm=Comm("all_reduce", 1e6, group, (), (0,), ("x", 1, 0)))
    prog.add(rank=0, stream="s2", name="b", kind="dp", comm=Comm("all_reduce", 1e6, group, (), (0,), ("y", 1, 0)))
    prog.runs.append((0, first, first + 2, object()))
    eng = Engine(prog, cl, "flow", {"all_reduce": "ring"})
    assert _segment_share(eng) == 0.0


def test_a_run_is_no_segment_where_stopping_would_hold_back_a_later_task():
    """Run [c1, t (other stream, also waits for ``a``, on the clock), c2 (after c1 only)]:
    stopped at t, the segment would hold back c2, and ``x`` waiting for c2 would start
    late. So it is left to the stream loop, and ``x`` starts when c2 ends."""
    cl = _node(4)
    group = (0, 1, 2, 3)
    size = 400e6
    prog = Program(ranks=[0], weight={0: 4})
    a = prog.add(rank=0, stream="s1", name="a", kind="tp", comm=Comm("all_reduce", size, group, (), (0,), ("x", 1, 0)))
    prog.add(rank=0, stream="s2", name="b", kind="dp", comm=Comm("all_reduce", size, group, (), (0,), ("y", 1, 0)))
    c0 = prog.add(rank=0, stream="compute", name="c0", kind="compute", duration_s=1e-4)
    prog.add(rank=0, stream="other", name="o0", kind="compute", duration_s=1e-4)
    first = len(prog.tasks)
    c1 = prog.add(rank=0, stream="compute", name="c1", kind="compute", duration_s=1e-4, deps=(c0.tid,))
    prog.add(rank=0, stream="other", name="t", kind="compute", duration_s=1e-4, deps=(c1.tid, a.tid))
    c2 = prog.add(rank=0, stream="compute", name="c2", kind="compute", duration_s=1e-4, deps=(c1.tid,))
    prog.runs.append((0, first, len(prog.tasks), object()))
    prog.add(rank=0, stream="s3", name="x", kind="dp", deps=(c2.tid,),
             comm=Comm("all_reduce", 1e6, group, (), (0,), ("z", 1, 0)))
    eng = Engine(prog, cl, "flow", {"all_reduce": "ring"})
    assert _segment_share(eng) == 0.0
    fast = eng.run()
    span = {s.name: s for s in fast.spans}
    assert span["x"].start_s == pytest.approx(span["c2"].end_s, abs=1e-15)
    assert span["x"].start_s < span["a"].end_s
    prog.runs.clear()
    slow = Engine(prog, cl, "flow", {"all_reduce": "ring"}).run()
    assert _rows(fast) == _rows(slow)
