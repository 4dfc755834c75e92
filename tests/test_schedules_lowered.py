"""Interleaved 1F1B, ZB-H1, DualPipe and custom schedules lowered and simulated.

Closed forms with uniform synthetic parts (free communication, no optimizer time), from
the schedules' papers (Narayanan et al. SC'21 Sec 2.2.2;
Qi et al. 2023; DeepSeek-V3 report Table 2), then the same schedules end to end from YAML.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

import clustersim
from clustersim.analysis.memory import PartStatic, StageStatic, inflight_peak, memory_report
from clustersim.api import _split_w
from clustersim.analysis.metrics import step_metrics
from clustersim.engine import run_program
from clustersim.errors import ConfigError
from clustersim.output.report import header_html
from clustersim.output.summary import format_summary
from clustersim.plan.mesh import Mesh
from clustersim.program.lower import Lowering, Symmetry, lower, run_passes
from clustersim.program.work import Block, StageWork
from clustersim.schedule import build_schedule, peak_in_flight, timeline

from .conftest import ROOT, scenario_dict
from .test_cli import run_cli, write_scenario
from .test_engine import node_cluster

REL = 1e-6
LAYERS = 2  # blocks per part in the synthetic work


def uniform_part(part: int, f_s: float, b_s: float, w_s: float) -> StageWork:
    """A part of LAYERS blocks: forward f_s, input-gradient backward b_s, weight gradient w_s
    (full backward b_s + w_s). Parts hold distinct layers, as real parts do."""
    layers = range(part * LAYERS, (part + 1) * LAYERS)

    def blocks(name: str, total_s: float) -> tuple[Block, ...]:
        return tuple(Block(name, layer, total_s / LAYERS, 0.0, 0.0, 0.0) for layer in layers)

    return StageWork(blocks("f", f_s), blocks("b", b_s + w_s), optimizer_s=0.0, local_params=0.0,
                     activation_bytes_per_mb=1.0, pp_send_bytes=1e6,
                     bwd_input=blocks("b", b_s), bwd_weight=blocks("w", w_s))


def uniform_run(name: str, p: int, m: int, f_s: float, b_s: float, w_s: float = 0.0, **opts):
    """(schedule, lowering, trace, metrics) of ``name`` over uniform parts, network ideal.

    For schedules without W, ``b_s + w_s`` is the (full) backward."""
    sched = build_schedule(name, p, m, **opts)
    mesh = Mesh(tp=1, dp=1, pp=p)
    work = [uniform_part(j, f_s, b_s, w_s) for j in range(sched.n_parts)]
    low = Lowering(mesh=mesh, schedule=sched, work=work, sym=Symmetry(mesh, True))
    trace = run_program(run_passes(low), node_cluster(p), network="ideal")
    return sched, low, trace, step_metrics(trace, world_size=p, peak_flops=1.0, tokens_per_step=1)


def idle_per_rank(metrics) -> list[float]:
    return [st["bubble_s"] for st in metrics["per_stage"]]


# --- closed forms ---------------------------------------------------------------------------

@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 12, 3), (8, 16, 2)])
def test_interleaved_bubble_closed_form(p, m, v):
    """v chunks per rank, each 1/v of a stage: F = 1, B = 2 per stage, F/v and B/v per chunk.

    Idle per rank (p-1)(F+B)/v (Narayanan et al. SC'21 Sec 2.2.2). Each rank computes m(F+B),
    so the step is m(F+B) + (p-1)(F+B)/v and the idle time is a fraction
    (p-1)/(v*m + p - 1) of the step (the paper's (p-1)/(v*m) is relative to the ideal m(F+B)).
    """
    f_s, b_s = 1.0, 2.0
    _, _, _, met = uniform_run("interleaved", p, m, f_s / v, b_s / v, v=v)
    idle = (p - 1) * (f_s + b_s) / v
    assert idle_per_rank(met) == pytest.approx([idle] * p, rel=REL)
    assert met["step_time_s"] == pytest.approx(m * (f_s + b_s) + idle, rel=REL)
    assert met["bubble_fraction"] == pytest.approx((p - 1) / (v * m + p - 1), rel=REL)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 16), (8, 9)])
def test_zb_h1_bubble_closed_form(p, m):
    """T_F = T_B = T_W = t (B the input gradient, so the full backward is 2t), as the paper's
    handcrafted schedules assume: idle per rank (p-1)(F + B_full - 2W) = (p-1)t
    (Qi et al. 2023, Sec 3.1). Each rank computes 3mt, so the idle time is a fraction
    (p-1)/(3m + p - 1) of the step. Holds for m >= p."""
    t = 0.5
    _, _, _, met = uniform_run("zb-h1", p, m, t, t, t)
    idle = (p - 1) * (t + 2 * t - 2 * t)
    assert idle_per_rank(met) == pytest.approx([idle] * p, rel=REL)
    assert met["step_time_s"] == pytest.approx(3 * m * t + idle, rel=REL)
    assert met["bubble_fraction"] == pytest.approx((p - 1) / (3 * m + p - 1), rel=REL)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (6, 12), (8, 16), (8, 20)])
def test_dualpipe_bubble_closed_form(p, m):
    """T_F = T_B = T_W = t. The schedule layer models an overlapped F&B chunk as one forward
    plus one full backward back to back (F&B = F + B_full = 3t, no gain from the overlap),
    B_full = 2t: idle per rank (p/2-1)(F&B + B_full - 3W) = (p-2)t (DeepSeek-V3 report,
    Table 2). Each rank computes m forwards and m full backwards (m/2 per direction on each
    of its two parts), 3mt, so the idle time is a fraction (p-2)/(3m + p - 2) of the step."""
    t = 0.25
    _, _, _, met = uniform_run("dualpipe", p, m, t, t, t)
    idle = (p / 2 - 1) * (3 * t + 2 * t - 3 * t)
    assert idle_per_rank(met) == pytest.approx([idle] * p, rel=REL, abs=1e-12)
    assert met["step_time_s"] == pytest.approx(3 * m * t + idle, rel=REL)
    assert met["bubble_fraction"] == pytest.approx((p - 2) / (3 * m + p - 2), rel=REL, abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 3), (2, 4), (4, 7), (4, 8), (8, 16), (8, 20)])
def test_zbv_bubble_closed_form(p, m):
    """ZB-V, T_F = T_B = T_W = t per chunk (half a stage): idle per rank (p-1)t, r before its
    first chunk and p-1-r after its last (Qi et al. 2023, Sec 6: no bubble in the steady
    state). Each rank computes both its chunks' F, B and W for every microbatch, 6mt, so the
    idle time is a fraction (p-1)/(6m + p - 1) of the step. Holds for m >= 2p - 1; rank p-1
    hands part p-1's output to itself."""
    t = 0.25
    _, _, _, met = uniform_run("zbv", p, m, t, t, t)
    idle = (p - 1) * t
    assert idle_per_rank(met) == pytest.approx([idle] * p, rel=REL)
    assert met["step_time_s"] == pytest.approx(6 * m * t + idle, rel=REL)
    assert met["bubble_fraction"] == pytest.approx((p - 1) / (6 * m + p - 1), rel=REL)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 11), (8, 16)])
def test_dualpipev_bubble_closed_form(p, m):
    """DualPipeV, T_F = T_B = T_W = t per chunk (half a stage), F&B = F + B_full = 3t: idle
    per rank (2p/2 - 1)(F&B + B_full - 3W) = 2(p-1)t, DualPipe's formula for its 2p stages
    (DeepSeek-V3 report, Table 2). Each rank computes both its chunks' F, B and W for every
    microbatch, 6mt, so the idle time is a fraction 2(p-1)/(6m + 2(p-1)) of the step."""
    t = 0.25
    _, _, _, met = uniform_run("dualpipev", p, m, t, t, t)
    idle = (p - 1) * (3 * t + 2 * t - 3 * t)
    assert idle_per_rank(met) == pytest.approx([idle] * p, rel=REL, abs=1e-12)
    assert met["step_time_s"] == pytest.approx(6 * m * t + idle, rel=REL)
    assert met["bubble_fraction"] == pytest.approx(2 * (p - 1) / (6 * m + 2 * (p - 1)), rel=REL, abs=1e-12)


@pytest.mark.parametrize("name,p,m,opts", [
    ("gpipe", 4, 6, {}), ("1f1b", 4, 6, {}), ("interleaved", 4, 8, {"v": 2}), ("interleaved", 3, 6, {"v": 3}),
    ("zb-h1", 4, 6, {}), ("zb-h1", 4, 3, {}), ("dualpipe", 4, 8, {}), ("dualpipe", 6, 14, {}),
    ("zbv", 4, 8, {}), ("zbv", 4, 5, {}), ("dualpipev", 4, 8, {}), ("dualpipev", 3, 7, {}),
])
def test_lowered_step_is_the_schedule_layers_timeline(name, p, m, opts):
    """With free communication the engine runs exactly the schedule layer's list scheduling,
    for uneven durations too (where the closed forms above no longer hold): same step, same
    idle per rank, and the same activation peak per rank as ``peak_in_flight``."""
    f_s, b_s, w_s = 1.0, 2.0, 0.5
    sched, low, trace, met = uniform_run(name, p, m, f_s, b_s, w_s, **opts)
    durations = {"F": f_s, "B": b_s, "W": w_s} if sched.split_backward else {"F": f_s, "B": b_s + w_s}
    tl = timeline(sched, durations)
    assert met["step_time_s"] == pytest.approx(tl.makespan, rel=1e-9)
    assert idle_per_rank(met) == pytest.approx(tl.idle(), rel=1e-9, abs=1e-9)
    parts = [tuple(PartStatic(j, 0.0, 1.0, tuple(range(j * LAYERS, (j + 1) * LAYERS))) for j in low.parts_of[q])
             for q in range(p)]
    assert [inflight_peak(trace, r, parts[r]) for r in trace.ranks] == peak_in_flight(sched)


def test_activation_peaks_of_the_papers():
    """1F1B and ZB-H1 hold at most p microbatches, DualPipe p+1 (DeepSeek-V3 Table 2),
    interleaved rank 0 its warm-up plus one chunk-microbatches."""
    p, m = 4, 8

    def peaks(name, **opts):
        sched, low, trace, _ = uniform_run(name, p, m, 1.0, 1.0, 1.0, **opts)
        parts = [tuple(PartStatic(j, 0.0, 1.0, tuple(range(j * LAYERS, (j + 1) * LAYERS))) for j in low.parts_of[q])
                 for q in range(p)]
        return [inflight_peak(trace, r, parts[r]) for r in trace.ranks]

    assert peaks("1f1b") == [4, 3, 2, 1]
    assert peaks("zb-h1") == [p] * p
    assert peaks("dualpipe") == [p + 1] * p
    assert peaks("zbv") == [2 * p] * p  # chunks of half a stage: 1F1B's p stages
    assert peaks("dualpipev") == [2 * p + 1] * p  # DualPipe's p+1 for its 2p half-stage chunks
    assert peaks("interleaved", v=2)[0] == (p - 1) * 2 + (2 - 1) * p + 1  # Megatron's warm-up + 1


@pytest.mark.parametrize("m_b,m_w", [(1.0, 0.25), (0.1, 1.0)])
def test_zb_h1_activation_memory_per_rank_of_the_paper(m_b, m_w):
    """Qi et al. 2023 Sec 2.3: ZB-H1's rank r (of p, T_F = T_B = T_W) holds (p-r) M_B + r M_W
    at its peak, with M_W < M_B. Where M_W > M_B (full recompute: B recomputes what W keeps)
    the peak is the moment a B ends before the oldest held-back W runs, (p-r-1) M_B + (r+1) M_W
    (rank 0's W follows its B at once, but its backward is split all the same). DualPipe keeps
    its p+1 microbatches' M_B when M_W < M_B, 1F1B its p - r."""
    p, m = 4, 8

    def peaks(name):
        sched, low, trace, _ = uniform_run(name, p, m, 1.0, 1.0, 1.0)
        statics = [StageStatic(q, 0.0, 0.0, 0.0, 0.0, m_b, split_w=_split_w(low, q), parts=tuple(
            PartStatic(j, 0.0, m_b, tuple(range(j * LAYERS, (j + 1) * LAYERS)), wgrad_bytes_per_mb=m_w)
            for j in low.parts_of[q])) for q in range(p)]
        return [st["peak_bytes"] for st in memory_report(trace, statics, 1e9)["stages"]]

    want = [max((p - r) * m_b + r * m_w, (p - r - 1) * m_b + (r + 1) * m_w) for r in range(p)]
    assert peaks("zb-h1") == pytest.approx(want, rel=1e-12)
    if m_w < m_b:
        assert peaks("dualpipe") == pytest.approx([(p + 1) * m_b] * p, rel=1e-12)
        assert peaks("1f1b") == pytest.approx([(p - r) * m_b for r in range(p)], rel=1e-12)


# --- what the lowering builds ---------------------------------------------------------------

def _small(**parallel):
    d = scenario_dict(model={"layers": 8}, parallel={"tp": 2, "pp": 4, "dp": 2, **parallel},
                      training={"global_batch_size": 16})
    return clustersim.load_scenario(d, base_dir=ROOT)


def test_split_backward_costs_the_full_backward_and_keeps_communication_in_b():
    """B + W = the full backward; W carries every gradient and communicates only to gather
    again, under SP, the inputs of its column-parallel GEMMs (QKV, MLP up, LM head: two a
    layer, one for the head; beside the out projection's and MLP down's weight gradients,
    which need none); B keeps the rest of the TP communication (the embedding's, under SP, as
    a communication-only B block), blocking where the full backward overlaps the reductions
    with those GEMMs' weight gradients."""
    from collections import Counter

    from clustersim.program.work import stage_work

    def comms(blocks) -> Counter:
        return Counter(c for b in blocks for c in (*b.pre, *b.overlap, *b.post))

    for sc in (_small(schedule="zb-h1"), _small(schedule="zb-h1", sp=True)):
        for j in range(sc.n_parts):
            w = stage_work(sc, j, sc.cluster.gpu)
            full = sum(b.duration_s for b in w.bwd)
            assert sum(b.duration_s for b in w.bwd_input + w.bwd_weight) == pytest.approx(full, rel=1e-12)
            assert sum(b.flops for b in w.bwd_input + w.bwd_weight) == pytest.approx(sum(b.flops for b in w.bwd))
            assert all(not b.post for b in w.bwd_weight)
            regathers = comms(w.bwd_weight)
            gemms = 2 * sc.layers_per_part[j] + (j == sc.n_parts - 1)
            assert sum(regathers.values()) == (gemms if sc.parallel.sp else 0)
            assert {c.op for c in regathers} <= {"all_gather"}
            assert comms(w.bwd_input) + regathers == comms(w.bwd)
            assert all(not b.overlap for b in w.bwd_input)
            assert sum(b.params for b in w.bwd_weight) == pytest.approx(w.local_params)
            assert sum(b.params for b in w.bwd_input) == 0.0
    rc = clustersim.load_scenario(scenario_dict(model={"layers": 8}, parallel={"tp": 2, "pp": 4, "dp": 2,
                                                                                "schedule": "zb-h1"},
                                                training={"global_batch_size": 16, "recompute": "full"}),
                                  base_dir=ROOT)
    w = stage_work(rc, 1, rc.cluster.gpu)
    assert [b.name for b in w.bwd_input[:3]] == ["recompute attn", "recompute mlp", "mlp"]  # recompute heads B
    assert w.bwd_weight[0].name == "mlp"


def test_interleaved_sends_wrap_from_the_last_rank_to_the_first():
    sc = _small(schedule="interleaved", vpp=2)
    prog, low = lower(sc, collapse=False)
    fwd = {(t.rank, t.comm.group[1]) for t in prog.tasks if t.comm is not None and t.name == "send act"}
    last, first = sc.mesh.rank(tp=0, dp=0, pp=3), sc.mesh.rank(tp=0, dp=0, pp=0)
    assert (last, first) in fwd  # stage 3 (rank 3) -> stage 4 (rank 0)
    assert low.pp_edges == ((0, 1), (0, 3), (1, 0), (1, 2), (2, 1), (2, 3), (3, 0), (3, 2))
    assert sc.layers_per_part == [1] * 8 and low.parts_of == {0: (0, 4), 1: (1, 5), 2: (2, 6), 3: (3, 7)}


def test_dualpipe_holds_each_part_twice_and_all_reduces_the_copies():
    tied = _small(schedule="dualpipe")
    untied = clustersim.load_scenario(scenario_dict(model={"layers": 8, "tied_embeddings": False},
                                                    parallel={"tp": 2, "pp": 4, "dp": 2, "schedule": "dualpipe"},
                                                    training={"global_batch_size": 16}), base_dir=ROOT)
    for sc in (tied, untied):
        prog, low = lower(sc)
        assert low.parts_of == {0: (0, 3), 1: (1, 2), 2: (1, 2), 3: (0, 3)}
        names = [t.name for t in prog.tasks]
        assert not any("tied" in n for n in names)  # ranks 0 and 3 hold both ends: the tie is local
        replicas = [t for t in prog.tasks if t.stream.startswith("dp_replica_")]
        assert {t.comm.group for t in replicas} >= {(0, 12), (4, 8)}
        s = clustersim.simulate(sc).summary
        one = clustersim.simulate(clustersim.load_scenario(
            scenario_dict(model=sc.cfg.model.model_dump(), parallel={"tp": 2, "pp": 4, "dp": 2},
                          training={"global_batch_size": 16}), base_dir=ROOT)).summary
        # the parameters twice over the pipeline: rank 0 holds what 1F1B's ranks 0 and 3 hold
        rank0 = s["memory"]["stages"][0]["params"]
        assert rank0 == pytest.approx(one["memory"]["stages"][0]["params"] + one["memory"]["stages"][3]["params"]
                                      - (sc.model.vocab * sc.model.hidden / 2 if sc.model.tied_embeddings else 0))
        assert s["plan"]["parts_per_stage"] == [[0, 3], [1, 2], [1, 2], [0, 3]]


# --- end to end -----------------------------------------------------------------------------

@pytest.mark.parametrize("parallel", [
    {"schedule": "interleaved", "vpp": 2},
    {"schedule": "zb-h1"},
    {"schedule": "dualpipe"},
    {"schedule": "dualpipe", "zero": 1},
    {"schedule": "dualpipe", "zero": 3, "sp": True},
    {"schedule": "zb-h1", "zero": 3, "sp": True},
    {"schedule": "interleaved", "vpp": 2, "sp": True, "zero": 1},
    {"schedule": "zbv"},
    {"schedule": "zbv", "zero": 3, "sp": True},
    {"schedule": "dualpipev"},
    {"schedule": "dualpipev", "zero": 1, "sp": True},
])
def test_collapsed_equals_all_ranks(parallel):
    """On the 2-node cluster of SMALL (TP2 x PP4 x DP2). Stage 1 (GPUs 4-7) sends to stage 2
    (GPUs 8-11) across rails, which PXN forwards through stage 0's GPUs (and stage 2's gradients
    through stage 3's): the collapsed run sees that traffic only on the simulated GPU of those
    stages, so step times agree to 1e-4 and the split of idle time to 1e-3 of the step, not exactly (test_engine.py has exact
    cases). Not listed: interleaved with ZeRO-2/3, where the collapsed step is ~0.1 % short
    (docs/architecture.md, Known limitations)."""
    sc = _small(**parallel)
    full = clustersim.simulate(sc, collapse=False).summary
    rep = clustersim.simulate(sc, collapse=True).summary
    assert rep["simulation"]["simulated_ranks"] == 4 and full["simulation"]["simulated_ranks"] == 16
    for key in ("step_time_s", "mfu", "hfu", "compute_s"):
        assert rep[key] == pytest.approx(full[key], rel=1e-4), key
    assert rep["bubble_fraction"] == pytest.approx(full["bubble_fraction"], abs=1e-3)
    for kind, v in full["exposed_comm_s"].items():
        assert rep["exposed_comm_s"][kind] == pytest.approx(v, abs=1e-3 * full["step_time_s"]), kind
    # bytes agree exactly; the timeline's instants move with the timing (1e-4 above)
    timeless = lambda mem: {**mem, "stages": [{k: v for k, v in st.items() if k not in ("peak_t_s", "timeline")}  # noqa: E731
                                             for st in mem["stages"]]}
    assert timeless(rep["memory"]) == timeless(full["memory"])
    for a, b in zip(rep["memory"]["stages"], full["memory"]["stages"]):
        assert a["peak_t_s"] == pytest.approx(b["peak_t_s"], abs=1e-3 * full["step_time_s"])


def _shipped(name: str, **parallel) -> dict:
    """A shipped scenario as a dict, its parallel section changed (schedule_file dropped)."""
    d = yaml.safe_load((ROOT / "scenarios" / f"{name}.yaml").read_text())
    d = copy.deepcopy(d)
    for k in ("vpp", "schedule_file"):
        d["parallel"].pop(k, None)
    d["parallel"].update(parallel)
    return d


def _summary(d: dict) -> dict:
    return clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT / "scenarios")).summary


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zero_bubble", "dualpipe", "custom_schedule"])
def test_shipped_schedule_scenarios_run(name):
    s = clustersim.simulate(ROOT / "scenarios" / f"{name}.yaml").summary
    assert 0.3 < s["mfu"] < 0.6 and s["memory"]["fits"]


def test_interleaved_and_zb_h1_have_a_smaller_bubble_than_1f1b_on_the_same_plan():
    base = _summary(_shipped("interleaved_1f1b", schedule="1f1b"))
    inter = clustersim.simulate(ROOT / "scenarios" / "interleaved_1f1b.yaml").summary
    zb = clustersim.simulate(ROOT / "scenarios" / "zero_bubble.yaml").summary
    assert inter["plan"]["microbatches"] == zb["plan"]["microbatches"] == base["plan"]["microbatches"]
    assert inter["bubble_fraction"] < base["bubble_fraction"]
    assert zb["bubble_fraction"] < base["bubble_fraction"]
    assert inter["step_time_s"] < base["step_time_s"] and zb["step_time_s"] < base["step_time_s"]


def test_zbv_has_a_smaller_bubble_than_zb_h1_on_the_same_plan():
    """ZB-V on zero_bubble.yaml's plan (PP4, 16 microbatches): half ZB-H1's bubble in unit
    time; with the real parts (rank 0 holds the embedding and the LM head, each microbatch
    crosses the ranks twice) still a smaller bubble and a shorter step."""
    zb = clustersim.simulate(ROOT / "scenarios" / "zero_bubble.yaml").summary
    zbv = _summary(_shipped("zero_bubble", schedule="zbv"))
    assert zbv["bubble_fraction"] < zb["bubble_fraction"] and zbv["step_time_s"] < zb["step_time_s"]
    assert zbv["plan"]["parts_per_stage"] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_custom_schedule_equal_to_1f1b_gives_the_1f1b_step():
    custom = clustersim.simulate(ROOT / "scenarios" / "custom_schedule.yaml").summary
    one = _summary(_shipped("custom_schedule", schedule="1f1b"))
    assert custom["step_time_s"] == one["step_time_s"]
    assert custom["memory"] == one["memory"]


def test_custom_schedule_from_a_dict_reads_its_file_relative_to_base_dir(tmp_path):
    text = (ROOT / "scenarios" / "schedules" / "custom_1f1b_4x8.txt").read_text()
    (tmp_path / "s.txt").write_text(text)
    d = _shipped("custom_schedule", schedule="custom", schedule_file="s.txt")
    d["cluster"]["topology"] = str(ROOT / "topologies" / "dgx-h100.yaml")
    sc = clustersim.load_scenario(d, base_dir=tmp_path)
    assert sc.schedule.n_microbatches == 8



V_SHAPE_WITH_W = """\
0F0 0F1 0F2 0F3 3F0 3B0 3F1 3B1 3W0 3F2 3B2 3W1 3F3 3B3 0B0 0B1 0B2 0W0 0B3 0W1 0W2 0W3 3W2 3W3
1F0 2F0 1F1 2F1 1F2 2F2 1F3 2F3 2B0 1B0 2B1 1B1 2W0 2B2 1B2 1W0 2B3 1B3 1W1 2W1 1W2 2W2 1W3 2W3
"""


def test_v_shaped_custom_schedule_with_w_passes_the_checks(tmp_path):
    """A V-shaped schedule (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2: ZB-V's
    placement) runs stage 3's W of a microbatch before stage 0's B of it, on the same rank:
    the phase-order check takes W part by part, and the step is simulated, checks on."""
    (tmp_path / "v.txt").write_text(V_SHAPE_WITH_W)
    d = _shipped("custom_schedule", schedule="custom", schedule_file="v.txt")
    d["cluster"]["topology"] = str(ROOT / "topologies" / "dgx-h100.yaml")
    d["parallel"].update(tp=4, pp=2, dp=1)
    d["cluster"]["nodes"] = 1
    d["training"]["global_batch_size"] = 4 * d["training"].get("micro_batch_size", 1)
    r = clustersim.simulate(clustersim.load_scenario(d, base_dir=tmp_path))
    assert r.summary["step_time_s"] > 0
    w3 = min(s.start_s for s in r.trace.spans if s.phase == "W" and s.mb == 0 and s.rank == 0 and s.name == "W head")
    b0 = max(s.end_s for s in r.trace.spans if s.phase == "B" and s.mb == 0 and s.rank == 0 and s.layer == 0)
    assert w3 < b0  # the case the check must allow

def test_interleaved_groups_take_microbatches_pp_does_not_divide():
    """PP4 x vpp 2 over 6 microbatches, in one group of 6 (Megatron-LM's
    ``--microbatch-group-size-per-virtual-pipeline-stage 6``): it runs, and its idle time is below 1F1B's on the same 6 microbatches (chunks of
    half a stage fill the warm-up sooner). The summary and the plan line name the group."""
    d = scenario_dict(model={"layers": 8}, parallel={"tp": 2, "pp": 4, "dp": 2, "schedule": "interleaved", "vpp": 2,
                                                     "vpp_group": 6}, training={"global_batch_size": 12})
    d["simulation"] = {"network": "ideal"}
    grouped = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT)).summary
    d["parallel"] = {"tp": 2, "pp": 4, "dp": 2, "schedule": "1f1b"}
    plain = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT)).summary
    assert grouped["plan"]["vpp_group"] == 6 and grouped["plan"]["microbatches"] == 6
    assert grouped["bubble_fraction"] < plain["bubble_fraction"]
    assert "interleaved v2 (groups of 6)" in format_summary(grouped)
    assert "interleaved v2 (groups of 6) · 6 microbatches" in header_html(grouped)  # the report's plan line


# --- bad input ------------------------------------------------------------------------------

BAD = [
    ("interleaved m % pp", {"parallel": {"tp": 2, "pp": 4, "dp": 2, "schedule": "interleaved", "vpp": 2},
                            "training": {"global_batch_size": 12}}, "parallel.schedule", "m=6 microbatches"),
    ("interleaved vpp 1", {"parallel": {"tp": 2, "pp": 4, "dp": 2, "schedule": "interleaved"},
                           "training": {"global_batch_size": 16}}, "parallel.vpp", "vpp >= 2"),
    ("vpp without interleaved", {"parallel": {"vpp": 2}}, "parallel.vpp", "interleaved only"),
    ("interleaved m % pp names the group", {"parallel": {"tp": 2, "pp": 4, "dp": 2, "schedule": "interleaved",
                                                         "vpp": 2}, "training": {"global_batch_size": 12}},
     "parallel.schedule", "parallel.vpp_group sets a larger group"),
    ("vpp_group short last group", {"parallel": {"tp": 2, "pp": 4, "dp": 2, "schedule": "interleaved", "vpp": 2,
                                                 "vpp_group": 4}, "training": {"global_batch_size": 20}},
     "parallel.vpp_group", "m=10 microbatches (global_batch_size / (dp * micro_batch_size)) in groups of "
     "vpp_group=4 leave a last group of 2, fewer than pp=4"),
    ("vpp_group below pp", {"parallel": {"tp": 2, "pp": 4, "dp": 2, "schedule": "interleaved", "vpp": 2,
                                         "vpp_group": 2}, "training": {"global_batch_size": 16}},
     "parallel.vpp_group", "must be from pp=4 to m=8"),
    ("vpp_group past m", {"parallel": {"tp": 2, "pp": 4, "dp": 2, "schedule": "interleaved", "vpp": 2,
                                       "vpp_group": 9}, "training": {"global_batch_size": 16}},
     "parallel.vpp_group", "must be from pp=4 to m=8"),
    ("interleaved m < pp", {"parallel": {"tp": 2, "pp": 4, "dp": 2, "schedule": "interleaved", "vpp": 2,
                                         "vpp_group": 4}, "training": {"global_batch_size": 6}},
     "parallel.schedule", "to be at least pp=4"),
    ("vpp_group without interleaved", {"parallel": {"vpp_group": 2}}, "parallel.vpp_group",
     "interleaved only (schedule is 1f1b); leave it out"),
    ("too many chunks", {"parallel": {"schedule": "interleaved", "vpp": 4}, "training": {"global_batch_size": 8}},
     "parallel.vpp", "pp*vpp = 2*4 = 8 model chunks"),
    ("dualpipe odd pp", {"parallel": {"tp": 4, "pp": 1, "dp": 4, "schedule": "dualpipe"}}, "parallel.schedule",
     "even pp"),
    ("dualpipe few mbs", {"parallel": {"tp": 2, "pp": 4, "dp": 2, "schedule": "dualpipe"},
                          "training": {"global_batch_size": 12}}, "parallel.schedule", "at least 2*pp=8"),
    ("custom without file", {"parallel": {"schedule": "custom"}}, "parallel.schedule_file", "needs"),
    ("file without custom", {"parallel": {"schedule_file": "x.txt"}}, "parallel.schedule_file", "custom only"),
    ("missing file", {"parallel": {"schedule": "custom", "schedule_file": "nope.txt"}}, "parallel.schedule_file",
     "schedule file not found"),
    ("layers per part", {"parallel": {"schedule": "interleaved", "vpp": 2, "layers_per_stage": [2, 2]}},
     "parallel.layers_per_stage", "pp*vpp = 2*2 = 4"),
    ("zbv chunks", {"parallel": {"schedule": "zbv", "tp": 2, "pp": 4, "dp": 2}, "model": {"layers": 6}}, "parallel.pp",
     "2*pp = 8 model chunks (zbv places two on each rank) need at least one layer each, but model.layers=6"),
    ("zbv one rank", {"parallel": {"schedule": "zbv", "tp": 4, "pp": 1, "dp": 4}}, "parallel.schedule",
     "zbv needs pp >= 2"),
    ("zbv layers per part", {"parallel": {"schedule": "zbv", "layers_per_stage": [2, 2]}},
     "parallel.layers_per_stage", "2*pp = 2*2 (zbv places two on each rank) = 4"),
    ("dualpipev one rank", {"parallel": {"schedule": "dualpipev", "tp": 4, "pp": 1, "dp": 4}}, "parallel.schedule",
     "dualpipev needs pp >= 2"),
    ("dualpipev few mbs", {"parallel": {"tp": 2, "pp": 4, "dp": 2, "schedule": "dualpipev"},
                           "training": {"global_batch_size": 14}}, "parallel.schedule",
     "dualpipev needs m=7 microbatches (global_batch_size / (dp * micro_batch_size)) at least 2*pp=8"),
    ("dualpipev chunks", {"parallel": {"schedule": "dualpipev", "tp": 2, "pp": 4, "dp": 2},
                          "model": {"layers": 6}, "training": {"global_batch_size": 16}}, "parallel.pp",
     "2*pp = 8 model chunks (dualpipev places two on each rank) need at least one layer each"),
]


@pytest.mark.parametrize("what,change,field,words", BAD, ids=[b[0] for b in BAD])
def test_bad_schedule_settings_name_the_field(what, change, field, words):
    with pytest.raises(ConfigError) as err:
        clustersim.load_scenario(scenario_dict(**change), base_dir=ROOT)
    assert err.value.field == field and words in err.value.message, err.value.line()
    assert "\n" not in err.value.line()


@pytest.mark.parametrize("text,words", [
    ("0F0 0B0\n1F0 1B0\n", "custom schedule has 2 rows (ranks) but pp=4"),
    ("0F0 0X0\n", "'0X0' is not an action"),
    ("\n".join(f"{r}F0 {r}B0" for r in range(4)), "custom schedule has 1 microbatch but m=8"),
    ("0F0 0B0\n", "custom schedule has 1 row (rank) but pp=4"),
    ("0F0 0B0\n1F0 2F1 1B0\n2F0 2B0\n3F0 3B0\n",
     "stage 2 appears on rank 1 (token 2F1) and on rank 2 (token 2F0); a stage runs on exactly one rank"),
    # named as such, not by what they leave behind (a stage 4 without its backward, a gap)
    ("\n".join(f"{r}F0 {r}B0" for r in range(5)), "custom schedule has 5 rows (ranks) but pp=4"),
    ("\n".join(" ".join(f"{r}F{k} {r}B{k}" for k in (*range(7), 9)) for r in range(4)),
     "rank 0: microbatch 9 is past m=8 (microbatches are numbered 0..7)"),
])
def test_bad_custom_file_exit_2_one_line_no_output(tmp_path, root, text, words):
    d = scenario_dict(model={"layers": 8}, parallel={"tp": 2, "pp": 4, "dp": 2, "schedule": "custom",
                                                     "schedule_file": "bad.txt"},
                      training={"global_batch_size": 16})
    (tmp_path / "bad.txt").write_text(text)
    p = write_scenario(tmp_path, root, d)
    out = tmp_path / "out"
    r = run_cli("run", p, "--out", out)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert lines[0].startswith(f"error: {p}: parallel.schedule_file: {tmp_path / 'bad.txt'}: "), lines[0]
    assert words in lines[0]
    assert not out.exists()


def test_scenario_files_are_found_relative_to_the_scenario(tmp_path):
    path = Path(ROOT / "scenarios" / "custom_schedule.yaml")
    sc = clustersim.load_scenario(path)
    assert sc.schedule_path == str(path.parent / "schedules" / "custom_1f1b_4x8.txt")


def test_a_full_backward_written_b_then_w_gathers_beside_b():
    """Under SP a split W first gathers again the inputs of its column-parallel GEMMs (QKV,
    MLP up, LM head). A full backward written B then W (DualPipe's overlapped chunks and the
    backwards it does not queue) gathers them beside B's compute instead, as Megatron-LM's
    backward gathers beside the input gradient's GEMM: the same compute, the gathers moved
    (but the last B block's, which nothing in B would wait for), and in the trace only the
    split W's gathers and the fused W's last ones; every gather a dependency of a later task."""
    from clustersim.schedule.core import fused_weight_passes, split_weight_passes

    sc = _small(schedule="dualpipe", sp=True)
    low = clustersim.api.lower_step(sc)[1]
    for w in low.work:
        assert w.fused_input is not None and w.fused_weight is not None
        assert [b.duration_s for b in w.fused_input] == [b.duration_s for b in w.bwd_input]
        assert [b.duration_s for b in w.fused_weight] == [b.duration_s for b in w.bwd_weight]
        moved = sum(len(b.overlap) for b in w.fused_input) - sum(len(b.overlap) for b in w.bwd_input)
        kept = sum(len(b.pre) + len(b.overlap) for b in w.fused_weight)
        assert moved > 0 and moved + kept == sum(len(b.pre) + len(b.overlap) for b in w.bwd_weight)
        assert not w.fused_input[-1].overlap and not any(b.post for b in w.fused_weight)
    r = clustersim.simulate(sc)
    for q in range(low.mesh.pp):
        rank = next(k for k in r.trace.ranks if r.trace.stage_of.get(k, 0) == q)
        gathers = {j: sum(len(b.pre) + len(b.overlap) for b in low.work[j].bwd_weight) for j in low.parts_of[q]}
        kept = {j: sum(len(b.pre) + len(b.overlap) for b in low.work[j].fused_weight) for j in low.parts_of[q]}
        want = sum(gathers[low.part(stage)] for stage, _ in split_weight_passes(low.schedule, q)) + sum(
            kept[low.part(stage)] for stage, _ in fused_weight_passes(low.schedule, q))
        got = sum(1 for s in r.trace.spans if s.rank == rank and s.kind == "tp" and s.phase == "W")
        assert got == want and fused_weight_passes(low.schedule, q)
    prog = clustersim.api.lower_step(sc)[0]  # every task a dependency of a later one, or the step's last
    tasks = prog.tasks
    needed = {d for t in tasks for d in t.deps}
    assert all(t.tid in needed for t in tasks if t.stream == "tp" and t.phase == "B")


def test_overlapped_chunks_take_turns_where_a_communication_stands_between_blocks():
    """In a DualPipe F&B chunk the chains take turns where one would wait on a communication:
    without TP, F's attention and router run in one turn, before its dispatch, and B's router
    and attention in one, after its dispatch's gradient, as the DeepSeek-V3 report pairs them
    (Fig. 4); the other chain's turn runs beside each all-to-all. Block by block, the tiny
    router blocks came between and each dispatch was waited for with nothing beside it."""
    from .conftest import scenario_dict

    d = scenario_dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 1},
                      model={"layers": 8, "moe": {"experts": 8, "top_k": 2, "expert_ffn": 1024}, "mlp": "swiglu",
                             "bias": False},
                      parallel={"tp": 1, "pp": 4, "dp": 2, "ep": 2, "schedule": "dualpipe"},
                      training={"global_batch_size": 32})
    r = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT))
    in_chunks = 0
    for rank in {s.rank for s in r.trace.spans}:
        comp = sorted((s for s in r.trace.spans if s.rank == rank and s.stream == "compute" and s.phase in "FB"),
                      key=lambda s: s.start_s)
        for a, b, c in zip(comp, comp[1:], comp[2:]):
            if a.name in ("F attn", "B router"):  # the next block of the same layer, in the same turn
                assert (b.name, b.mb, b.layer) == ({"F attn": "F router", "B router": "B attn"}[a.name], a.mb, a.layer)
                in_chunks += c.phase != a.phase  # the other chain's turn next: inside a chunk
    assert in_chunks > 0


def test_overlapped_chunks_hide_sp_collectives_as_they_hide_all_reduces():
    """In a DualPipe F&B chunk one chain's TP collectives run beside the other's compute. Under
    SP each block has a gather before it and a reduce-scatter after; both chains share the
    rank's tp stream in issue order, so each block's reduce-scatter is issued after the other
    chain's next block (its gather first) and the alternation hides them: Llama-2 70B's
    DualPipe exposes far less TP than 1F1B does with SP, within 4x of what it exposes without."""
    import yaml

    def tp_exposed(**parallel):
        d = yaml.safe_load((ROOT / "scenarios" / "llama2_70b_64gpu.yaml").read_text())
        d["parallel"].update(parallel)
        s = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT / "scenarios")).summary
        return s["exposed_comm_s"]["tp"]

    dual_sp, dual, plain_sp = tp_exposed(schedule="dualpipe", sp=True), tp_exposed(schedule="dualpipe"), \
        tp_exposed(sp=True)
    assert dual_sp < 0.25 * plain_sp and dual_sp < 4 * dual
