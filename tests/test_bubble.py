"""The bubble taken apart (clustersim.analysis.bubble) against constructed cases with known answers."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.analysis.metrics import step_metrics
from clustersim.engine import run_program
from clustersim.plan.mesh import Mesh
from clustersim.program.lower import Lowering, Symmetry, run_passes
from clustersim.program.work import Block, StageWork
from clustersim.schedule import build_schedule

from .conftest import scenario_dict
from .test_engine import node_cluster

REL = 1e-9


def pipeline_metrics(schedule: str, f_s: list[float], b_s: list[float], m: int, layers: int = 2):
    """Stage q computes f_s[q] forward and b_s[q] backward per microbatch; free communication."""
    p = len(f_s)
    mesh = Mesh(tp=1, dp=1, pp=p)

    def work(q):
        fwd = tuple(Block("f", i, f_s[q] / layers, 0.0, 0.0, 0.0) for i in range(layers))
        bwd = tuple(Block("b", i, b_s[q] / layers, 0.0, 0.0, 0.0) for i in range(layers))
        return StageWork(fwd, bwd, optimizer_s=0.0, local_params=0.0, activation_bytes_per_mb=0.0, pp_send_bytes=1e6)

    low = Lowering(mesh=mesh, schedule=build_schedule(schedule, p, m), work=[work(q) for q in range(p)],
                   sym=Symmetry(mesh, True))
    trace = run_program(run_passes(low), node_cluster(p), network="ideal")
    return step_metrics(trace, world_size=p, peak_flops=1.0, tokens_per_step=1)


def parts_add_up(st: dict) -> float:
    return st["warm_up_s"] + st["cool_down_s"] + st["dependency_s"]["total"] + st["imbalance_s"]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_balanced_1f1b_is_all_fill_and_drain(p, m):
    F, B = 1.0, 2.0
    met = pipeline_metrics("1f1b", [F] * p, [B] * p, m)
    for s, st in enumerate(met["per_stage"]):
        assert st["warm_up_s"] == pytest.approx(s * F + (p - 1 - s) * B, rel=REL)
        assert st["cool_down_s"] == pytest.approx((p - 1 - s) * F + s * B, rel=REL)
        assert st["dependency_s"]["total"] == pytest.approx(0.0, abs=1e-12)
        assert st["imbalance_s"] == pytest.approx(0.0, abs=1e-12)
        assert parts_add_up(st) == pytest.approx(st["bubble_s"], rel=REL)
    b = met["bubble"]
    assert b["fraction"] == met["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1), rel=1e-6)


@pytest.mark.parametrize("p,m", [(2, 3), (4, 8)])
def test_gpipe_fill_holds_the_turnaround(p, m):
    F, B = 1.0, 3.0
    met = pipeline_metrics("gpipe", [F] * p, [B] * p, m)
    for s, st in enumerate(met["per_stage"]):
        assert st["warm_up_s"] == pytest.approx(s * F + (p - 1 - s) * (F + B), rel=REL)
        assert st["cool_down_s"] == pytest.approx(s * B, rel=REL)
        assert st["dependency_s"]["total"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("slow,delay_s", [(1, 0.5), (3, 0.25), (0, 1.0)])
def test_one_slow_stage_shows_its_planted_delay_as_imbalance(schedule, slow, delay_s):
    """Stage ``slow`` takes ``delay_s`` longer per forward: m * delay_s of extra work that
    every other stage must wait out."""
    p, m = 4, 8
    f = [1.0] * p
    f[slow] += delay_s
    met = pipeline_metrics(schedule, f, [2.0] * p, m)
    for s, st in enumerate(met["per_stage"]):
        want = 0.0 if s == slow else m * delay_s
        assert st["imbalance_s"] == pytest.approx(want, rel=REL, abs=1e-12)
        assert parts_add_up(st) == pytest.approx(st["bubble_s"], rel=REL)
        assert min(st["warm_up_s"], st["cool_down_s"], st["dependency_s"]["total"]) >= -1e-12
    balanced = pipeline_metrics(schedule, [1.0] * p, [2.0] * p, m)
    # the step grows, by at most the planted delay (the slow stage absorbs some in its own fill)
    assert balanced["step_time_s"] < met["step_time_s"] <= balanced["step_time_s"] + m * delay_s + 1e-9


def test_straggler_without_pipeline_is_imbalance_waiting_on_collectives(root):
    """TP 8 alone, GPU 2 computes 1.5x slower: its TP peers wait for it at every collective,
    so each idles the straggler's extra compute, less what the straggler hides of the backward
    all-reduces: each runs beside a QKV or MLP-up weight gradient
    (work.tp_overlapped_backward), and a GPU sees exposed what outlasts its own wgrad, which
    the straggler's slower wgrad covers more of. The straggler never idles."""
    d = scenario_dict(cluster={"nodes": 1, "what_if": [{"gpu": 2, "slowdown": 1.5}]},
                      parallel={"tp": 8, "pp": 1, "dp": 1}, training={"global_batch_size": 2})
    r = clustersim.simulate(clustersim.load_scenario(d, base_dir=root))
    s = r.summary
    spans = r.trace.spans
    compute = {k: sum(x.dur_s for x in spans if x.rank == k and x.kind == "compute") for k in range(8)}
    assert compute[2] == pytest.approx(1.5 * compute[0], rel=1e-9)

    def beyond_wgrad(k: int) -> float:
        """What of rank k's backward all-reduces outlasts the wgrad it runs beside."""
        wgrad = {(x.mb, x.layer, x.name): x.end_s for x in spans if x.rank == k and x.kind == "compute"}
        ars = [x for x in spans if x.rank == k and x.kind == "tp" and x.name.endswith(" dgrad")]
        assert len(ars) == (2 * r.scenario.model.layers + 1) * r.scenario.microbatches  # two a layer, the head
        return sum(max(0.0, x.end_s - max(x.start_s, wgrad[(x.mb, x.layer, x.name.replace(" AR ", " ").replace(" dgrad", " wgrad"))]))
                   for x in ars)

    assert beyond_wgrad(0) > beyond_wgrad(2)  # the straggler's wgrad hides more
    for row in s["bubble"]["per_rank"]:
        k = row["rank"]
        want = compute[2] - compute[k] - (beyond_wgrad(k) - beyond_wgrad(2))
        assert row["imbalance_s"] == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert parts_add_up(row) == pytest.approx(row["bubble_s"], rel=1e-9)
        assert row["warm_up_s"] == pytest.approx(0.0, abs=1e-12)  # no pipeline to fill
    assert parts_add_up(s["bubble"]) == pytest.approx(s["bubble"]["bubble_s"], rel=1e-9)
    assert s["bubble"]["bubble_s"] == pytest.approx(s["bubble_fraction"] * s["step_time_s"], rel=1e-9)


def test_straggler_with_blocking_tp_all_reduces_idles_its_peers_by_its_extra_compute(root):
    """pp = 1, GPU 2 computes 1.5x slower, TP all-reduces blocking both ways
    (``parallel.tp_async_allreduce: false``): its TP peers wait for it at every collective and
    the other replica at the DP reduction, and each GPU idles exactly the straggler's extra
    compute (its compute is 1.5x theirs)."""
    d = scenario_dict(cluster={"nodes": 1, "what_if": [{"gpu": 2, "slowdown": 1.5}]},
                      parallel={"tp": 4, "pp": 1, "dp": 2, "tp_async_allreduce": False},
                      training={"global_batch_size": 4})
    r = clustersim.simulate(clustersim.load_scenario(d, base_dir=root))
    s = r.summary
    compute = {k: sum(x.dur_s for x in r.trace.spans if x.rank == k and x.kind == "compute") for k in range(8)}
    assert compute[2] == pytest.approx(1.5 * compute[0], rel=1e-9)
    assert not [x for x in r.trace.spans if x.name.endswith(" wgrad")]  # the backward is not cut
    for row in s["bubble"]["per_rank"]:
        want = compute[2] - compute[row["rank"]]
        assert row["imbalance_s"] == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert parts_add_up(row) == pytest.approx(row["bubble_s"], rel=1e-9)


def test_bubble_parts_are_never_negative_when_imbalance_takes_them_all():
    """A rank whose whole bubble is imbalance (the busiest rank computes far longer): warm-up
    and cool-down go to zero, never to a rounding below it (-1e-17 s in summary.json)."""
    import random

    import numpy as np

    from clustersim.analysis.bubble import DEP_KINDS, split_bubble

    rng = random.Random(7)
    for _ in range(2000):
        edges = sorted(rng.uniform(0.0, 1.0) for _ in range(2 * rng.randint(1, 4)))
        lo, hi = np.array(edges[0::2]), np.array(edges[1::2])
        step_s = 1.0 + rng.random()
        got = split_bubble(np.array([]), np.array([], dtype=np.int64), dict.fromkeys(DEP_KINDS, -1), (lo, hi), step_s, float((hi - lo).sum()),
                           10.0, False, None, None)
        assert got.warm_up_s >= 0.0 and got.cool_down_s >= 0.0, got
        assert got.imbalance_s == got.bubble_s
