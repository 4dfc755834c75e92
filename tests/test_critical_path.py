"""The critical path and exposed communication traced to its cause, on constructed cases."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.analysis.critical_path import PathTask, critical_path, path_report
from clustersim.analysis.exposure import exposed_collectives
from clustersim.analysis.invariants import check_critical_path
from clustersim.engine import Engine
from clustersim.plan.mesh import Mesh
from clustersim.program.lower import Lowering, Symmetry, run_passes
from clustersim.program.tasks import Comm, Program
from clustersim.program.work import Block, StageWork
from clustersim.schedule import build_schedule

from .conftest import scenario_dict
from .test_engine import node_cluster


def pipeline(schedule: str, f_s: list[float], b_s: float, m: int):
    p = len(f_s)
    mesh = Mesh(tp=1, dp=1, pp=p)
    work = [StageWork((Block("f", 0, f, 0.0, 0.0, 0.0),), (Block("b", 0, b_s, 0.0, 0.0, 0.0),), optimizer_s=0.0,
                      local_params=0.0, activation_bytes_per_mb=0.0, pp_send_bytes=1e6) for f in f_s]
    low = Lowering(mesh=mesh, schedule=build_schedule(schedule, p, m), work=work, sym=Symmetry(mesh, True))
    prog = run_passes(low)
    trace = Engine(prog, node_cluster(p), network="ideal").run()
    return prog, trace


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_balanced_pipeline_path_is_all_compute_and_as_long_as_the_step(schedule):
    p, m, F, B = 4, 8, 1.0, 2.0
    prog, trace = pipeline(schedule, [F] * p, B, m)
    path = critical_path(prog, trace)
    rep = path_report(path, trace.end_s)
    assert rep["length_s"] == pytest.approx(trace.end_s, rel=1e-12)
    assert rep["compute_s"] == pytest.approx((m + p - 1) * (F + B), rel=1e-12)
    assert rep["wait_s"] == 0.0
    # consecutive: each task starts when the previous one ends
    for a, b in zip(path, path[1:]):
        assert b.start_s == pytest.approx(a.end_s, abs=1e-12)
    assert path[0].start_s == 0.0 and path[-1].end_s == trace.end_s


def test_path_runs_through_the_slow_stage():
    """Stage 2 takes 3x as long per forward: the steady state runs at its pace. The path holds
    its m forwards and m-1 backwards; B of the last microbatch-but-one runs on stage 2 while
    the last forward goes down to stage 3 and back, which is the path then."""
    m, B = 8, 2.0
    f = [1.0, 1.0, 3.0, 1.0]
    prog, trace = pipeline("1f1b", f, B, m)
    rep = path_report(critical_path(prog, trace), trace.end_s)
    on = {}
    for seg in rep["segments"]:
        on[seg["stage"]] = on.get(seg["stage"], 0.0) + seg["compute_s"]
    assert on[2] == pytest.approx(m * 3.0 + (m - 1) * B, rel=1e-12)
    assert max(on, key=on.get) == 2
    assert rep["length_s"] == pytest.approx(trace.end_s, rel=1e-12)


def test_shipped_scenario_path_adds_up_to_the_step(root):
    r = clustersim.simulate(root / "scenarios/llama2_70b_64gpu.yaml")
    cp = r.summary["critical_path"]
    assert cp["length_s"] == pytest.approx(r.summary["step_time_s"], rel=1e-12)
    assert cp["compute_s"] + cp["comm_s"] == pytest.approx(cp["length_s"], rel=1e-12)
    assert sum(cp["by_kind_s"].values()) == pytest.approx(cp["length_s"], rel=1e-12)
    assert sum(seg["compute_s"] + seg["comm_s"] for seg in cp["segments"]) == pytest.approx(cp["length_s"], rel=1e-12)
    # communication on the path cannot exceed what each kind spent on the wire in the step
    assert cp["by_kind_s"]["tp"] > 0 and cp["by_kind_s"]["pp"] > 0
    assert cp["ranks_visited"] == r.summary["plan"]["pp"]  # one simulated rank per stage


# --- exposed communication: which collective, which link, what shared it -------------------
def _two_node_cluster(root):
    return clustersim.load_scenario(scenario_dict(cluster={"nodes": 2}), base_dir=root).cluster


def _allreduces(names: list[str]) -> Program:
    """Rank 0 runs one 1 GiB all-reduce per name with GPU 8 (the next node), each on its own
    stream, all at t = 0: they cross the same NICs."""
    prog = Program(ranks=[0], weight={0: 1})
    for i, n in enumerate(names):
        prog.add(rank=0, stream=f"s{i}", name=f"AR {n}", kind="dp",
                 comm=Comm("all_reduce", float(1 << 30), (0, 8), (), (0,), ("dp", (0, 8), i)))
    return prog


def test_a_lone_collective_is_exposed_on_its_nic_and_shares_it_with_nothing(root):
    cl = _two_node_cluster(root)
    prog = _allreduces(["grads"])
    eng = Engine(prog, cl, algorithms={"all_reduce": "ring"})
    trace = eng.run()
    (c,) = exposed_collectives(prog, trace, eng, cl)
    assert c["collective"] == "dp all_reduce: AR grads"
    assert c["exposed_s"] == pytest.approx(trace.end_s, rel=1e-12)  # no compute to hide under
    assert c["alone"] is True and c["shared_with"] == []
    assert c["bottleneck"]["kind"] == "nic" and c["bottleneck"]["link"].startswith("n0.nic0->")
    # the bottleneck's traffic time is the collective's bandwidth term: 2(n-1)/n * S / B, n = 2
    assert c["bottleneck"]["busy_s"] == pytest.approx((1 << 30) / c["bottleneck"]["bw_Bps"], rel=1e-12)


def test_an_nvls_bottleneck_s_rate_is_the_share_nvls_sustains(root):
    """Under NVLS each GPU sends S up its NVLink port and receives S down, at NVLS's own share
    of the line rate (nvls_efficiency, not the port's usable nvlink.efficiency): the rate the
    bottleneck names is that share, so its traffic over it is its busy time, which is also
    the span's closed form (nothing else runs)."""
    cl = clustersim.load_scenario(scenario_dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 2}),
                                  base_dir=root).cluster
    prog = Program(ranks=[0], weight={0: 8})
    prog.add(rank=0, stream="tp", name="AR x", kind="tp",
             comm=Comm("all_reduce", float(1 << 30), tuple(range(8)), (), (0,), ("tp", tuple(range(8)), 0)))
    eng = Engine(prog, cl, algorithms={"all_reduce": "nvls"})
    trace = eng.run()
    (c,) = exposed_collectives(prog, trace, eng, cl)
    bn = c["bottleneck"]
    assert c["algorithm"] == "nvls" and bn["kind"] == "nvlink"
    assert bn["bw_Bps"] == pytest.approx(cl.cfg.node.nvlink.bw_GBps * 1e9 * cl.gpu.nvls_efficiency, rel=1e-12)
    assert bn["busy_s"] == pytest.approx((1 << 30) / bn["bw_Bps"], rel=1e-12)
    assert 0 < trace.end_s - bn["busy_s"] < 20e-6  # the span: that and its latency steps, microseconds
    from clustersim.output.report import causes_html

    assert f"(nvlink, {bn['bw_Bps'] / 1e9:.0f} GB/s NVLS sustains)" in causes_html({"exposed_comm_causes": [c]})


def test_two_collectives_on_one_nic_each_name_the_other(root):
    cl = _two_node_cluster(root)
    alone = Engine(_allreduces(["a"]), cl, algorithms={"all_reduce": "ring"}).run().end_s
    prog = _allreduces(["a", "b"])
    eng = Engine(prog, cl, algorithms={"all_reduce": "ring"})
    trace = eng.run()
    causes = {c["collective"]: c for c in exposed_collectives(prog, trace, eng, cl)}
    assert set(causes) == {"dp all_reduce: AR a", "dp all_reduce: AR b"}
    for me, other in (("a", "b"), ("b", "a")):
        c = causes[f"dp all_reduce: AR {me}"]
        assert c["alone"] is False
        (shared,) = c["shared_with"]
        assert shared["collective"] == f"dp all_reduce: AR {other}"
        assert shared["overlap_s"] == pytest.approx(c["example"]["end_s"] - c["example"]["start_s"], rel=1e-12)
        # sharing the NIC halves each one's rate: the bandwidth term doubles
        assert c["exposed_s"] == pytest.approx(2 * alone, rel=0.01)


def test_spans_of_one_collective_at_once_count_once(root):
    """Two all-reduces named alike but for a number (one group, as DualPipe's two parts'
    gradients) run at once on one rank: the group's exposed and busy time is their union, no
    more than the kind's own (it was their sum, twice the dp exposed time)."""
    cl = _two_node_cluster(root)
    prog = _allreduces(["part 0 grads", "part 1 grads"])
    eng = Engine(prog, cl, algorithms={"all_reduce": "ring"})
    trace = eng.run()
    (c,) = exposed_collectives(prog, trace, eng, cl)
    assert c["collective"] == "dp all_reduce: AR part # grads" and c["count_per_gpu"] == 2
    spans = [s for s in trace.spans if s.kind == "dp"]
    union_s = max(s.end_s for s in spans) - min(s.start_s for s in spans)
    assert sum(s.end_s - s.start_s for s in spans) > 1.5 * union_s  # they did run at once
    assert c["exposed_s"] == pytest.approx(union_s, rel=1e-12) and c["comm_s"] == pytest.approx(union_s, rel=1e-12)


def test_ties_last_bits_count_in_the_length_but_not_as_waits():
    """A tie's binding predecessor may end up to INSTANT_S before its successor starts (the
    lowest id among ends within INSTANT_S of the latest). Two such slivers of 6.6e-10 s on
    one path added up to 1.3e-9 s, past the check's 1e-9 s: a scenario (4 Llama 3 servers
    a leaf, TP2 x DP16 x EP2 with ZeRO-3 and a NIC cable at half bandwidth) was refused as
    a simulator bug. The length keeps them; the waits stay 0."""
    sliver = 6.6e-10
    tasks, t = [], 0.0
    for i in range(4):
        start = t + (sliver if i else 0.0)
        tasks.append(PathTask(i, 0, "compute", f"F{i}", "compute", start, start + 1e-3, 0, i, 0))
        t = start + 1e-3
    rep = path_report(tasks, t)
    assert rep["wait_s"] == 0.0
    assert rep["length_s"] == pytest.approx(t, abs=1e-15)
    # path tasks that overlap are no tie: they count twice, and the check sees it
    over = [task._replace(start_s=task.start_s - 1e-4 * bool(task.tid)) for task in tasks]
    summary = {"step_time_s": t, "critical_path": path_report(over, t)}
    assert summary["critical_path"]["length_s"] > t + 1e-4 and check_critical_path(summary)


def test_a_scenario_whose_path_has_ties_passes_its_checks(root, tmp_path):
    """The scenario above, end to end: simulated with every invariant checked."""
    import yaml

    topo = yaml.safe_load((root / "topologies" / "roce-clos-llama3.yaml").read_text())
    topo.update(nodes=4, fabric={"kind": "leaf_spine", "nodes_per_leaf": 4, "spines": 4, "rail_optimized": False,
                                 "latency_us": 0.6, "efficiency": 0.9})
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topo))
    result = clustersim.simulate({
        "name": "ties", "cluster": {"topology": str(tmp_path / "topology.yaml"),
                                    "what_if": [{"link": "n0.nic4-leaf0.0", "bw_factor": 0.5}]},
        "model": {"name": "tiny", "layers": 8, "hidden": 1024, "heads": 16, "vocab": 32000, "seq_len": 2048,
                  "moe": {"experts": 8, "top_k": 2, "expert_ffn": 1024}},
        "parallel": {"tp": 2, "pp": 1, "dp": 16, "zero": 3, "ep": 2, "sp": True},
        "training": {"micro_batch_size": 1, "global_batch_size": 32}})
    cp = result.summary["critical_path"]
    assert cp["length_s"] == pytest.approx(result.summary["step_time_s"], abs=1e-12) and cp["wait_s"] == 0.0


def test_a_collective_hidden_but_for_less_than_a_nanosecond_is_no_cause(root):
    """Exposed time is a span's length less the compute inside it: a sliver under a
    nanosecond per GPU (rounding's dust, where the two are equal) names no cause; 10 ns does."""
    cl = _two_node_cluster(root)
    alone = Engine(_allreduces(["a"]), cl, algorithms={"all_reduce": "ring"}).run().end_s
    for sliver_s, listed in ((1e-10, False), (1e-8, True)):
        prog = _allreduces(["a"])
        prog.add(rank=0, stream="compute", name="F mlp", kind="compute", duration_s=alone - sliver_s)
        eng = Engine(prog, cl, algorithms={"all_reduce": "ring"})
        trace = eng.run()
        causes = exposed_collectives(prog, trace, eng, cl)
        assert [c["collective"] for c in causes] == (["dp all_reduce: AR a"] if listed else [])
        if listed:
            assert causes[0]["exposed_s"] == pytest.approx(sliver_s, rel=1e-3)


def test_covered_time_before_each_instant():
    import numpy as np

    from clustersim.analysis.exposure import covered_s

    merged = [(1.0, 2.0), (3.0, 5.0)]
    t = np.array([0.0, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 9.0])
    assert covered_s(t, merged).tolist() == [0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 2.0, 3.0, 3.0]
    assert covered_s(t, []).tolist() == [0.0] * len(t)


@pytest.mark.parametrize("crumb_on", ["x", "y"])
def test_communications_sharing_the_bottleneck_alike_are_named_by_name_whatever_their_last_bits(root, crumb_on):
    """Overlaps equal to nine digits rank by name: a copied-in cycle (engine.repeat) moves
    span times by float crumbs, which reordered an MoE layer's two recomputed all-to-alls
    between a step simulated whole and the same step copied in (bench/fuzz_repeat.py 23)."""
    from types import SimpleNamespace

    from clustersim.analysis.exposure import _explain

    cl = _two_node_cluster(root)
    prog = _allreduces(["me", "x", "y"])
    eng = Engine(prog, cl, algorithms={"all_reduce": "ring"})
    a, b = 1.0, 2.0
    ends = {"x": 1.5, "y": 1.5}
    ends[crumb_on] += 2e-16  # the last bit of 1.5
    during = [SimpleNamespace(tid=i, kind="dp", op="all_reduce", name=f"AR {n}", start_s=0.5, end_s=ends[n])
              for i, n in ((1, "x"), (2, "y"))]
    info = _explain(prog.task(0), eng, cl, during, a, b, prog.task)
    assert [s["collective"] for s in info["shared_with"]] == ["dp all_reduce: AR x", "dp all_reduce: AR y"]
    assert info["shared_with"][0]["overlap_s"] == pytest.approx(0.5, rel=1e-12)


def test_a_collective_s_members_overlap_an_example_once(root):
    """What shared the bottleneck overlapped the example for the union of its spans' overlaps:
    a collective's members each have a span at the same times (one instance), counted once,
    not once per member GPU (a ZeRO-3 gather over 8 GPUs overlapped its example eightfold,
    longer than the example lasted, and a collapsed run, which has fewer of the members,
    said another figure); instances one after another add up."""
    from types import SimpleNamespace

    from clustersim.analysis.exposure import _explain

    cl = _two_node_cluster(root)
    prog = _allreduces(["me", "x", "y"])
    eng = Engine(prog, cl, algorithms={"all_reduce": "ring"})
    a, b = 1.0, 2.0
    during = [SimpleNamespace(tid=1, kind="dp", op="all_reduce", name="AR x", start_s=0.5, end_s=1.25),  # a member
              SimpleNamespace(tid=1, kind="dp", op="all_reduce", name="AR x", start_s=0.5, end_s=1.25),  # another
              SimpleNamespace(tid=2, kind="dp", op="all_reduce", name="AR y", start_s=1.25, end_s=1.5),  # one instance,
              SimpleNamespace(tid=2, kind="dp", op="all_reduce", name="AR y", start_s=1.5, end_s=1.75)]  # the next
    info = _explain(prog.task(0), eng, cl, during, a, b, prog.task)
    assert {s["collective"]: s["overlap_s"] for s in info["shared_with"]} == {
        "dp all_reduce: AR x": pytest.approx(0.25, rel=1e-12), "dp all_reduce: AR y": pytest.approx(0.5, rel=1e-12)}


def test_what_shared_an_exposed_collective_s_link_reads_the_same_collapsed(root):
    """long_context_cp_128k simulates 2 of its 64 ranks: what shared each cause's bottleneck,
    and for how long, is what every rank's run says, and no overlap outlasts its example (the
    gradients' all-reduce overlapped the TP gathers' examples twice over, member by member)."""
    sc = clustersim.load_scenario(root / "scenarios" / "long_context_cp_128k.yaml")
    collapsed, every = (clustersim.simulate(sc, collapse=c).summary["exposed_comm_causes"] for c in (None, False))
    shared = [[(c["collective"], [(x["collective"], x["overlap_s"]) for x in c["shared_with"]]) for c in s]
              for s in (collapsed, every)]
    assert any(x for _, x in shared[0])
    for (name, ours), (name_all, theirs) in zip(*shared, strict=True):
        assert name == name_all and [k for k, _ in ours] == [k for k, _ in theirs]
        assert [v for _, v in ours] == pytest.approx([v for _, v in theirs], rel=1e-9)
    for c in every:
        for x in c["shared_with"]:
            assert x["overlap_s"] <= (c["example"]["end_s"] - c["example"]["start_s"]) * (1 + 1e-12)


@pytest.mark.parametrize("collective, said", [
    ("dp all_reduce: AR grads bucket #", "dp all-reduce of gradients, every bucket"),
    ("dp reduce_scatter: RS expert grads bucket #", "dp reduce-scatter of expert gradients, every bucket"),
    ("tp all_reduce: B AR attn dgrad", "tp backward all-reduce of attention input gradient"),
    ("dp all_gather: F AG params", "dp forward all-gather of parameters"),
    ("dp all_reduce: AR grads shard bucket # (replicas)",
     "dp all-reduce of gradient shards over the replicas, every bucket"),
    ("pp send: recv grad", "pp receive of gradients"),
    ("pp send: send act", "pp send of activations"),
    # every counter folded to # said once, at the end
    ("dp all_reduce: AR part # grads bucket # (replicas)",
     "dp all-reduce of gradients over the replicas, every part and bucket"),
    ("cp shift: F shift attn ring #", "cp forward shift of attention, every ring step"),
    ("tp reduce_scatter: F RS attn proj #", "tp forward reduce-scatter of attention proj, every chunk"),
    ("optimizer: optimizer step", "optimizer: optimizer step"),  # (no collective's short name: said as it is)
    ("offload: grads to host block #", "offload: grads to host, every block"),  # (but for its pieces' count)
    ("pp all_gather: F AG act", "pp forward all-gather of activations"),  # (parallel.pp_scatter_gather's)
])
def test_the_terminal_says_the_exposed_collectives_in_words(collective, said):
    """The terminal's "top exposed" lines spell out the span names' short words ("dp
    all_reduce: AR grads bucket #" read as a code); summary.json keeps the names."""
    from clustersim.output.summary import format_summary, plain_collective

    assert plain_collective(collective) == said
    r = clustersim.simulate(clustersim.load_scenario(scenario_dict(parallel={"tp": 1, "pp": 1, "dp": 16},
                                                                      training={"global_batch_size": 16})))
    causes = r.summary["exposed_comm_causes"]
    assert causes and all(c["collective"].startswith(f"{c['kind']} ") for c in causes)
    top = [ln for ln in format_summary(r.summary).splitlines()
           if ln.startswith("top exposed") or ln.startswith(" " * 16) and " s  " in ln][:len(causes)]
    for line, c in zip(top, causes):
        assert f" s  {plain_collective(c['collective'])}" in line
    assert any("AR grads bucket #" in c["collective"] for c in causes)
    assert not any("#" in ln for ln in top)


def test_a_collective_sharing_its_link_with_its_own_kind_says_another(root):
    """DualPipe's two parts reduce their gradients at once on one NIC: the terminal says the
    all-reduce shares the link with another of its own, not with itself."""
    from clustersim.output.summary import format_summary

    r = clustersim.simulate(root / "scenarios" / "dualpipe.yaml")
    c = r.summary["exposed_comm_causes"][0]
    assert c["shared_with"][0]["collective"] == c["collective"]
    line = next(ln for ln in format_summary(r.summary).splitlines() if ln.startswith("top exposed"))
    assert line.endswith(", shared with another dp all-reduce of gradients over the replicas, every part and bucket")
    # one group's spans at once count once: no more than the kind's own exposed time
    assert c["exposed_s"] <= r.summary["exposed_comm_s"]["dp"] * (1 + 1e-12)
