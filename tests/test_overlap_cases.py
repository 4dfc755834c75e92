"""Exposed and hidden communication on constructed cases whose answer is known in advance.

``exposed_comm_s[kind]`` is the time a GPU's communication of that kind is in flight while its
compute stream is idle; ``hidden_comm_s[kind]`` the rest of that kind's busy time
(clustersim/analysis/metrics.py). The cases:

* hand-built work (one pipeline rank, two DP ranks) whose gradient buckets are all launched
  while a long, parameter-free block still computes: every all-reduce hides, ``dp`` exposed 0;
  the same with parameters in that last block: its bucket is launched after the backward and is
  exposed for exactly its ring all-reduce time;
* a real scenario with one gradient bucket: it cannot start before the backward ends, so the
  exposed ``dp`` time is the all-reduce's ring closed form ``2(n-1)/n S/B + 2(n-1) alpha``, over
  NVLink inside a node and over the NICs between two nodes;
* the same scenario with small buckets: part of the reduction runs under the backward; the
  exposed time is the last bucket's end minus the last backward compute's end;
* for several plans (TP, PP, DP, CP, EP), exposed + hidden = busy time per kind, recomputed here
  from the trace spans with an interval sweep of this file's own.

In a scenario the last gradient bucket always holds the last block of the backward (the
embedding on the first stage, the first layer's attention elsewhere), and the optimizer waits
for it, so a scenario with dp > 1 never reports ``dp`` exposed 0: at best, what is exposed is
the last bucket. The fully hidden case therefore uses hand-built work.
"""

from __future__ import annotations

import itertools

import pytest

import clustersim
from clustersim.analysis.metrics import step_metrics
from clustersim.engine import run_program
from clustersim.hardware.topology import TopologyCfg, build_cluster
from clustersim.plan.mesh import Mesh
from clustersim.program.lower import Lowering, Symmetry, run_passes
from clustersim.program.work import Block, StageWork
from clustersim.schedule import build_schedule

from .conftest import scenario_dict

KINDS = ("tp", "cp", "ep", "pp", "dp")
RING = {"all_reduce": "ring"}  # hold the all-reduce to the ring closed form (no tree, no NVLS)


# ---------------------------------------------------------------- helpers of this file
def merged(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint union of (start, end) intervals, by a sweep over +1/-1 boundary events
    (independent of the package's own interval code)."""
    spans = [(a, b) for a, b in intervals if b > a]
    events = sorted([(a, -1) for a, _ in spans] + [(b, 1) for _, b in spans])
    out, depth, start = [], 0, 0.0
    for t, d in events:  # at equal times, starts (-1) sort first, so touching intervals join
        if d < 0:
            if depth == 0:
                start = t
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                out.append((start, t))
    return out


def total(u) -> float:
    return sum(b - a for a, b in u)


def overlap(u, v) -> float:
    """Length of the intersection of two merged interval lists (two-pointer sweep)."""
    i = j = 0
    out = 0.0
    while i < len(u) and j < len(v):
        lo, hi = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        if hi > lo:
            out += hi - lo
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return out


def ring_allreduce_closed_form(size_bytes: float, n: int, bw_Bps: float, alpha_s: float) -> float:
    """nccl-tests doc/PERFORMANCE.md: 2(n-1) latency rounds, each GPU sends 2(n-1)/n of S."""
    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * size_bytes / bw_Bps


def simulate(root, **sections):
    return clustersim.simulate(clustersim.load_scenario(scenario_dict(**sections), base_dir=root))


# ---------------------------------------------------------------- hand-built: fully hidden
NV_BW_Bps = 100e9  # NVLink of the hand-built node: 100 GB/s, no latency, efficiency 1
P = 1_000_000  # parameters per gradient-carrying block
GRAD_BYTES = 4  # fp32 gradients (Lowering's default)


def two_gpu_node():
    cfg = TopologyCfg.model_validate({"gpu": "A100-SXM4-80GB", "nodes": 1,
                                      "node": {"gpus": 2, "nvlink": {"bw_GBps": NV_BW_Bps / 1e9,
                                                                     "efficiency": 1.0, "latency_us": 0.0}},
                                      "fabric": {"kind": "none"}})
    return build_cluster(cfg)


def dp2_trace(tail_params: float, tail_s: float = 5e-3):
    """One pipeline rank, two DP ranks, one microbatch. Backward: two 1 ms blocks with P
    parameters each, then a ``tail_s`` block with ``tail_params`` parameters. Buckets of P
    parameters: one all-reduce after each block that carries parameters."""
    mesh = Mesh(tp=1, dp=2, pp=1)
    fwd = (Block("f", 0, 1e-3, 0.0, 0.0, 2 * P + tail_params),)
    bwd = (Block("b1", 1, 1e-3, 0.0, 0.0, P), Block("b0", 0, 1e-3, 0.0, 0.0, P),
           Block("tail", -1, tail_s, 0.0, 0.0, tail_params))
    work = [StageWork(fwd, bwd, optimizer_s=0.0, local_params=2 * P + tail_params, activation_bytes_per_mb=0.0,
                      pp_send_bytes=0.0)]
    low = Lowering(mesh=mesh, schedule=build_schedule("1f1b", 1, 1), work=work, sym=Symmetry(mesh, True),
                   dp_bucket_params=P)
    trace = run_program(run_passes(low), two_gpu_node(), network="flow", algorithms=RING)
    return trace, step_metrics(trace, world_size=2, peak_flops=1.0, tokens_per_step=1)


def tail_span(trace):
    """The backward's last block (layer -1; compute spans are named by their phase)."""
    return next(s for s in trace.spans if s.kind == "compute" and s.phase == "B" and s.layer == -1)


def test_buckets_launched_under_a_long_block_are_fully_hidden():
    trace, m = dp2_trace(tail_params=0.0)
    ar = ring_allreduce_closed_form(P * GRAD_BYTES, 2, NV_BW_Bps, 0.0)  # 40 us
    dp = [s for s in trace.spans if s.kind == "dp"]
    assert len(dp) == 2  # the parameter-free tail forms no bucket
    assert [s.dur_s for s in dp] == pytest.approx([ar, ar], rel=1e-9)
    tail = tail_span(trace)
    assert max(s.end_s for s in dp) < tail.end_s  # both end while the tail computes
    assert m["exposed_comm_s"]["dp"] == 0.0
    assert m["exposed_comm_s"]["total"] == 0.0
    assert m["comm_s"]["dp"] == pytest.approx(2 * ar, rel=1e-9)
    assert m["hidden_comm_s"]["dp"] == pytest.approx(2 * ar, rel=1e-9)
    # fwd 1 ms + bwd 2 ms + tail 5 ms; nothing waits for the network
    assert m["step_time_s"] == pytest.approx(8e-3, rel=1e-12)


def test_a_bucket_launched_after_the_backward_is_exposed_for_its_whole_all_reduce():
    trace, m = dp2_trace(tail_params=P)
    ar = ring_allreduce_closed_form(P * GRAD_BYTES, 2, NV_BW_Bps, 0.0)
    dp = sorted((s for s in trace.spans if s.kind == "dp"), key=lambda s: s.start_s)
    assert len(dp) == 3
    tail = tail_span(trace)
    assert dp[-1].start_s == pytest.approx(tail.end_s, rel=1e-12)  # launched when the tail's grads are final
    assert m["exposed_comm_s"]["dp"] == pytest.approx(ar, rel=1e-9)
    assert m["hidden_comm_s"]["dp"] == pytest.approx(2 * ar, rel=1e-9)
    assert m["step_time_s"] == pytest.approx(8e-3 + ar, rel=1e-9)


# ---------------------------------------------------------------- scenarios: one bucket, no overlap
def layer_params(h: int) -> int:
    """GPT layer of SMALL (gelu, ffn 4h, biases, layernorm): 12h^2 weights + 13h biases and norms."""
    return 12 * h * h + 13 * h


def all_params(m) -> int:
    """SMALL: layers, tied word embedding, learned positions, final layernorm."""
    return m.layers * layer_params(m.hidden) + m.vocab * m.hidden + m.seq_len * m.hidden + 2 * m.hidden


def rank_params(m, tp: int) -> float:
    """One TP rank's share of :func:`all_params` (Megatron): the two layernorms and the two
    row-parallel biases of each layer (6h), the learned positions and the final layernorm are
    whole on every rank; the rest splits over TP."""
    whole = m.layers * 6 * m.hidden + m.seq_len * m.hidden + 2 * m.hidden
    return (all_params(m) - whole) / tp + whole


ONE_NODE_DP8 = {"cluster": {"topology": "topologies/dgx-a100.yaml", "nodes": 1},
                "parallel": {"tp": 1, "pp": 1, "dp": 8}, "simulation": {"collectives": RING}}
TWO_NODES_DP2 = {"cluster": {"topology": "topologies/dgx-a100.yaml", "nodes": 2},
                 "parallel": {"tp": 8, "pp": 1, "dp": 2}, "simulation": {"collectives": RING}}


def last_backward_end(trace) -> float:
    return max(s.end_s for s in trace.spans if s.kind == "compute" and s.phase == "B")


@pytest.mark.parametrize("case", ["nvlink", "nic"])
def test_single_bucket_after_the_backward_is_fully_exposed_ring_closed_form(root, case):
    base = ONE_NODE_DP8 if case == "nvlink" else TWO_NODES_DP2
    n = base["parallel"]["dp"]
    r = simulate(root, **base, training={"global_batch_size": 2 * n, "dp_bucket_params": 10**12})
    m, s, cl = r.scenario.model, r.summary, r.scenario.cluster
    tp = base["parallel"]["tp"]
    size = rank_params(m, tp) * 4  # fp32 gradients of this rank's share
    if case == "nvlink":
        # dgx-a100.yaml: NVLink 300 GB/s x 0.77; a ring step GPU -> NVSwitch -> GPU, 1.5 us a hop
        bw, alpha = 300e9 * 0.77, 2 * 1.5e-6
    else:
        # DP pairs GPU k of node 0 with GPU k of node 1: one HDR NIC each, 200 Gb/s x 0.9
        bw, alpha = 200e9 / 8 * 0.9, cl.path_latency_s(cl.path(0, 8))
        assert cl.path_bw_Bps(cl.path(0, 8)) == pytest.approx(bw, rel=1e-12)
    expected = ring_allreduce_closed_form(size, n, bw, alpha)
    (ar,) = [sp for sp in r.trace.spans if sp.kind == "dp"]
    assert ar.size_bytes == pytest.approx(size, rel=1e-12)
    assert ar.start_s == pytest.approx(last_backward_end(r.trace), rel=1e-12)
    assert ar.dur_s == pytest.approx(expected, rel=1e-9)
    assert s["exposed_comm_s"]["dp"] == pytest.approx(expected, rel=1e-9)
    assert s["hidden_comm_s"]["dp"] == pytest.approx(0.0, abs=1e-15)
    # the optimizer step starts when the all-reduce ends: the exposed time is on the step
    opt = next(sp for sp in r.trace.spans if sp.name == "optimizer step")
    assert opt.start_s == pytest.approx(ar.end_s, rel=1e-12)


@pytest.mark.parametrize("base, bucket", [(ONE_NODE_DP8, 5_000_000), (TWO_NODES_DP2, 2_000_000)],
                         ids=["nvlink-tp1", "nic-tp8"])
def test_small_buckets_overlap_the_backward_partly(root, base, bucket):
    """Buckets run back to back on the DP stream from the first one's launch to the last one's
    end. Before the backward ends they are hidden wherever the compute stream is busy; with
    tp = 1 it is busy throughout, with tp = 8 it waits for every TP all-reduce between blocks,
    and the DP time under those waits is exposed too. After the backward, all of it is exposed::

        exposed dp = (last bucket end - last backward end) + compute idle in [first launch, backward end]
    """
    n = base["parallel"]["dp"]
    one = simulate(root, **base, training={"global_batch_size": 2 * n, "dp_bucket_params": 10**12})
    many = simulate(root, **base, training={"global_batch_size": 2 * n, "dp_bucket_params": bucket})
    assert many.trace.ranks == [0]  # pp = 1: one simulated rank stands for all
    dp = sorted((sp for sp in many.trace.spans if sp.kind == "dp"), key=lambda sp: sp.start_s)
    assert len(dp) >= 3
    end_b = last_backward_end(many.trace)
    first, last = dp[0].start_s, dp[-1].end_s
    assert first < end_b < last
    for a, b in itertools.pairwise(dp):  # back to back: the stream is busy over [first, last]
        assert b.start_s == pytest.approx(a.end_s, rel=1e-12)
    comp = merged((sp.start_s, sp.end_s) for sp in many.trace.spans if sp.kind == "compute")
    idle_before = (end_b - first) - overlap([(first, end_b)], comp)
    if base["parallel"]["tp"] == 1:
        assert idle_before == pytest.approx(0.0, abs=1e-15)  # nothing but compute on the rank
    else:
        assert idle_before > 0  # blocking TP all-reduces between backward blocks
    s = many.summary
    assert s["exposed_comm_s"]["dp"] == pytest.approx((last - end_b) + idle_before, rel=1e-9)
    assert s["hidden_comm_s"]["dp"] == pytest.approx((end_b - first) - idle_before, rel=1e-9)
    # bucketing hides part of it: less exposed than one bucket after the backward, same bytes
    assert s["exposed_comm_s"]["dp"] < one.summary["exposed_comm_s"]["dp"]
    assert sum(sp.size_bytes for sp in dp) == pytest.approx(
        sum(sp.size_bytes for sp in one.trace.spans if sp.kind == "dp"), rel=1e-12)


# ---------------------------------------------------------------- exposed + hidden = busy, per kind
MOE = {"moe": {"experts": 8, "top_k": 2, "expert_ffn": 1024}, "mlp": "swiglu", "bias": False}
PLANS = {
    "tp-pp-dp": {"parallel": {"tp": 4, "pp": 2, "dp": 2}},
    "sp-zero1": {"parallel": {"tp": 2, "pp": 2, "dp": 4, "sp": True, "zero": 1}},
    "interleaved": {"parallel": {"tp": 4, "pp": 2, "dp": 2, "schedule": "interleaved", "vpp": 2}},
    "cp-ring": {"parallel": {"tp": 2, "cp": 2, "pp": 2, "dp": 2}},
    "moe-ep": {"model": MOE, "parallel": {"tp": 1, "pp": 2, "dp": 8, "ep": 4}},
}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_exposed_plus_hidden_is_busy_time_per_kind_from_the_spans(root, plan):
    r = simulate(root, **PLANS[plan], training={"global_batch_size": 16})
    tr, s = r.trace, r.summary
    T, world = s["step_time_s"], s["world_size"]
    w = tr.weight
    assert sum(w.values()) == world
    want = {k: {"busy": 0.0, "exposed": 0.0} for k in KINDS + ("total",)}
    for rank, spans in tr.by_rank().items():
        comp = merged((sp.start_s, sp.end_s) for sp in spans if sp.kind == "compute")
        every = []
        for k in KINDS:
            u = merged((sp.start_s, sp.end_s) for sp in spans if sp.kind == k)
            every += u
            want[k]["busy"] += w[rank] * total(u) / world
            want[k]["exposed"] += w[rank] * (total(u) - overlap(u, comp)) / world
        u = merged(every)
        exposed_total = total(u) - overlap(u, comp)
        want["total"]["exposed"] += w[rank] * exposed_total / world
        want["total"]["busy"] += w[rank] * total(u) / world
        # compute + exposed + bubble = T on every rank
        bubble = T - total(merged(comp + u))
        assert total(comp) + exposed_total + bubble == pytest.approx(T, rel=1e-12)
    for k in KINDS:
        assert s["comm_s"][k] == pytest.approx(want[k]["busy"], rel=1e-9, abs=1e-15), k
        assert s["exposed_comm_s"][k] == pytest.approx(want[k]["exposed"], rel=1e-9, abs=1e-15), k
        assert s["exposed_comm_s"][k] + s["hidden_comm_s"][k] == pytest.approx(s["comm_s"][k], rel=1e-12, abs=1e-15), k
        assert 0.0 <= s["exposed_comm_s"][k] <= s["comm_s"][k] * (1 + 1e-12) + 1e-15, k
    assert s["exposed_comm_s"]["total"] == pytest.approx(want["total"]["exposed"], rel=1e-9, abs=1e-15)
    # hidden total: time any communication is in flight under compute, kinds counted once
    assert s["exposed_comm_s"]["total"] + s["hidden_comm_s"]["total"] == pytest.approx(
        want["total"]["busy"], rel=1e-9)
    assert s["hidden_comm_s"]["total"] <= sum(s["hidden_comm_s"][k] for k in KINDS) * (1 + 1e-12) + 1e-15
    # the plan's own kinds are exercised
    used = {"cp-ring": "cp", "moe-ep": "ep"}.get(plan, "tp")
    assert s["comm_s"][used] > 0 and s["comm_s"]["dp"] > 0
    for st in s["per_stage"]:
        assert st["compute_s"] + st["exposed_comm_s"]["total"] + st["bubble_s"] == pytest.approx(T, rel=1e-12)
