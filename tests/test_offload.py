"""Optimizer offload (``training.optimizer_offload``): the host's share of the optimizer step
against closed forms, its memory on the GPU and in the host, and what it refuses."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.api import memory_floor
from clustersim.errors import ConfigError
from clustersim.program.costs import adam_step_time_s
from clustersim.program.lower import lowering

from .conftest import ROOT, scenario_dict

GB = 1e9
HOST = {"memory_GB": 1024, "memory_GBps": 328, "copy_GBps": 12.5}  # dgx-a100.yaml's


def _scenario(offload: float = 1.0, overlap: bool = False, *, zero: int = 1, pp: int = 1, dp: int = 16,
              tp: int = 1, host: dict | None = None, collapse: bool = True) -> clustersim.Scenario:
    """The small model on two DGX A100 nodes, DP over every GPU (TP x PP x DP = 16)."""
    training = {"global_batch_size": 2 * dp, "optimizer_offload": offload}
    if overlap:
        training["overlap_offload_copies"] = True
    cluster = {"topology": "topologies/dgx-a100.yaml", "nodes": 2, **({"node": {"host": host}} if host else {})}
    d = scenario_dict(cluster=cluster, parallel={"tp": tp, "pp": pp, "dp": dp, "zero": zero},
                      training=training, simulation={"collapse_symmetric": collapse})
    return clustersim.load_scenario(d, base_dir=ROOT)


def _shard(sc: clustersim.Scenario) -> float:
    """The parameters one GPU's optimizer steps (stage 0's: its part's, over the DP ranks)."""
    w = lowering(sc, collapse=True).work[0]
    return w.local_params / sc.parallel.dp


def _piece_of(name: str) -> str:
    """A span's name without its piece's number (pipelined copies: "grads to host block 3")."""
    head, _, last = name.rpartition(" ")
    return head.removesuffix(" block") if head and last.isdigit() else name


def _spans(result, name: str) -> list:
    return [s for s in result.trace.spans if _piece_of(s.name) == name and s.rank == result.trace.ranks[0]]


def test_the_host_step_and_copies_take_their_closed_forms():
    """Each GPU copies 4 bytes a parameter down and up at copy_GBps; the CPU's Adam moves 28
    bytes a parameter at the node's host bandwidth shared by its 8 GPUs."""
    sc = _scenario(1.0)
    n = _shard(sc)
    r = clustersim.simulate(sc)
    (down,), (step,), (up,) = (_spans(r, k) for k in ("grads to host", "host optimizer step", "params from host"))
    assert down.end_s - down.start_s == pytest.approx(n * 4 / (HOST["copy_GBps"] * GB), rel=1e-12)
    assert up.end_s - up.start_s == pytest.approx(n * 4 / (HOST["copy_GBps"] * GB), rel=1e-12)
    assert step.end_s - step.start_s == pytest.approx(n * 28 / (HOST["memory_GBps"] * GB / 8), rel=1e-12)
    assert down.end_s <= step.start_s and step.end_s <= up.start_s
    assert {s.kind for s in (down, step, up)} == {"offload"}
    # the copies' spans carry what they move (the trace's bytes): 4 B a parameter each way
    assert down.size_bytes == pytest.approx(n * 4, rel=1e-12) and up.size_bytes == down.size_bytes
    assert not _spans(r, "optimizer step")  # all of it offloaded: the GPU steps nothing
    ag = [s for s in r.trace.spans if s.name == "AG params" and s.rank == r.trace.ranks[0]]
    assert ag and ag[0].start_s >= up.end_s


def _flow_shop(pieces: list[tuple[float, float, float]], gpu_end: float = 0.0) -> float:
    """When the last copy up ends, the copies down, the host's steps and the copies up each
    one after another on their own stream, a piece's step after its copy down and its copy
    up after its step and the GPU's Adam (ending at ``gpu_end``)::

        D_i = D_i-1 + d_i     S_i = max(S_i-1, D_i) + s_i     U_i = max(U_i-1, S_i, gpu_end) + u_i
    """
    down = step = up = 0.0
    for d, s, u in pieces:
        down += d
        step = max(step, down) + s
        up = max(up, step, gpu_end) + u
    return up


@pytest.mark.parametrize("overlap", [False, True])
def test_the_step_grows_by_the_host_chain_less_the_gpu_adam(overlap):
    """All offloaded, the GPU's Adam (after the last reduction) gives way to the copies down,
    the host's steps and the copies up. In one piece each::

        T1 - T0 = down + step + up - adam         down = up = 4 B x n / copy,  step = 28 B x n / share

    pipelined, one piece a backward block by its parameters, the host's step charged with the
    copies' 8 B a parameter of its memory too (36 B): the flow shop of the pieces."""
    base = _scenario(0.0)
    sc = _scenario(1.0, overlap)
    n = _shard(sc)
    copy = HOST["copy_GBps"] * GB
    share = HOST["memory_GBps"] * GB / 8
    if overlap:
        blocks = [b.params for b in lowering(sc, collapse=True).work[0].bwd if b.params > 0]
        # backward order: the head (here the final norm: the embedding is tied), attention and
        # MLP of each of the 4 layers, the embedding last (tokens and learned positions)
        m = sc.model
        assert len(blocks) == 2 * m.layers + 2 and blocks[-1] == (m.vocab + m.seq_len) * m.hidden
        assert sum(blocks) / sc.parallel.dp == pytest.approx(n, rel=1e-12)
        pieces = [(w / 16 * 4 / copy, w / 16 * 36 / share, w / 16 * 4 / copy) for w in blocks]
    else:
        pieces = [(n * 4 / copy, n * 28 / share, n * 4 / copy)]
    adam = adam_step_time_s(n, sc.cluster.gpu)
    t0 = clustersim.simulate(base).summary["step_time_s"]
    r = clustersim.simulate(sc)
    t1 = r.summary["step_time_s"]
    assert t1 - t0 == pytest.approx(_flow_shop(pieces) - adam, rel=1e-9)
    if not overlap:
        assert _flow_shop(pieces) == pytest.approx(sum(pieces[0]), rel=1e-12)
    else:  # a span a piece, numbered in order, each with its bytes
        downs = [s for s in r.trace.spans if s.rank == r.trace.ranks[0] and s.name.startswith("grads to host")]
        assert [s.name for s in downs] == [f"grads to host block {k}" for k in range(len(blocks))]
        assert [s.size_bytes for s in downs] == pytest.approx([w / 16 * 4 for w in blocks], rel=1e-12)


def test_a_slow_host_memory_slows_the_copies_too_and_a_straggler_only_its_gpu():
    """Host memory below the copy rate (1 GB/s for each of 8 GPUs against 12.5): a copy moves at
    the memory's share. A straggler GPU (what_if slowdown 2) computes slower; its host's step
    and copies keep their time."""
    slow_host = _scenario(1.0, host={**HOST, "memory_GBps": 8})
    n = _shard(slow_host)
    r = clustersim.simulate(slow_host)
    (down,), (step,) = _spans(r, "grads to host"), _spans(r, "host optimizer step")
    assert down.end_s - down.start_s == pytest.approx(n * 4 / 1e9, rel=1e-12)
    assert step.end_s - step.start_s == pytest.approx(n * 28 / 1e9, rel=1e-12)
    d = scenario_dict(cluster={"topology": "topologies/dgx-a100.yaml", "nodes": 2,
                               "what_if": [{"gpu": 0, "slowdown": 2.0}]},
                      parallel={"tp": 1, "pp": 1, "dp": 16, "zero": 1},
                      training={"global_batch_size": 32, "optimizer_offload": 1.0})
    r = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT))
    mine = [s for s in r.trace.spans if s.rank == 0 and s.kind == "offload"]
    assert {s.name for s in mine} == {"grads to host", "host optimizer step", "params from host"}
    for s in mine:
        base = n * (28 if s.name == "host optimizer step" else 4) / (
            HOST["memory_GBps"] * GB / 8 if s.name == "host optimizer step" else HOST["copy_GBps"] * GB)
        assert s.end_s - s.start_s == pytest.approx(base, rel=1e-12)


def test_a_partial_offload_steps_the_rest_on_the_gpu_beside_the_host():
    """Half offloaded: the GPU's Adam over the other half runs beside the CPU's step (after
    the copy down, which it queues behind) and each copy up waits for it."""
    sc = _scenario(0.5)
    n = _shard(sc)
    r = clustersim.simulate(sc)
    (gpu,), (down,), (step,), (up,) = (_spans(r, k) for k in ("optimizer step", "grads to host",
                                                               "host optimizer step", "params from host"))
    assert gpu.end_s - gpu.start_s == pytest.approx(adam_step_time_s(n / 2, sc.cluster.gpu), rel=1e-12)
    assert step.end_s - step.start_s == pytest.approx(n / 2 * 28 / (HOST["memory_GBps"] * GB / 8), rel=1e-12)
    assert gpu.start_s == pytest.approx(down.end_s) and step.start_s == pytest.approx(down.end_s)
    assert up.start_s == pytest.approx(max(gpu.end_s, step.end_s))
    # pipelined: the GPU's Adam starts with the first copy down, and no copy up before it ends
    r = clustersim.simulate(_scenario(0.5, True))
    (gpu,) = _spans(r, "optimizer step")
    downs, ups = _spans(r, "grads to host"), _spans(r, "params from host")
    assert gpu.start_s == pytest.approx(min(s.start_s for s in downs))
    assert len(ups) == 10 and min(s.start_s for s in ups) >= gpu.end_s - 1e-15


def test_the_gpu_keeps_what_is_not_offloaded_and_the_host_the_rest():
    """ZeRO-1 on 16 GPUs: 12 bytes a parameter of the shard on the GPU at no offload, (1 - f)
    of it at f; 16 bytes a parameter of the offloaded share in the host (master, m, v and the
    fp32 gradient buffer), 8 GPUs' worth a node; the GPU's other states unchanged."""
    m0 = clustersim.simulate(_scenario(0.0)).summary["memory"]
    for f in (0.25, 1.0):
        sc = _scenario(f)
        n = _shard(sc)
        m = clustersim.simulate(sc).summary["memory"]
        st, st0 = m["stages"][0], m0["stages"][0]
        assert st["optimizer_bytes"] == pytest.approx((1 - f) * st0["optimizer_bytes"], rel=1e-12)
        assert st0["optimizer_bytes"] == pytest.approx(12 * n, rel=1e-12)
        assert st["host_bytes"] == pytest.approx(16 * f * n, rel=1e-12)
        assert (st["params_bytes"], st["grads_bytes"]) == (st0["params_bytes"], st0["grads_bytes"])
        assert m["host"]["peak_bytes"] == pytest.approx(8 * st["host_bytes"], rel=1e-12)
        assert m["host"]["capacity_bytes"] == HOST["memory_GB"] * GB and m["host"]["fits"]
    assert m0["host"] is None and m0["stages"][0]["host_bytes"] == 0.0


def test_a_host_too_small_does_not_fit_and_the_floor_says_so():
    """A node's host memory below its GPUs' offloaded states: the plan does not fit (the
    summary's and the floor sweep and advise read), though every GPU does."""
    sc = _scenario(1.0)
    need = 8 * 16 * _shard(sc)
    small = _scenario(1.0, host={"memory_GB": need / GB * 0.9})
    m = clustersim.simulate(small).summary["memory"]
    assert all(st["fits"] for st in m["stages"]) and not m["host"]["fits"] and not m["fits"]
    assert m["host"]["peak_bytes"] == pytest.approx(need, rel=1e-12)
    assert not memory_floor(small)["fits"]
    assert memory_floor(_scenario(1.0, host={"memory_GB": need / GB * 1.1}))["fits"]


def test_offload_makes_a_plan_fit_that_does_not_without():
    """The guide's poorest case: Llama-2 70B on one DGX H100 with ZeRO-3 and full recompute does
    not fit (its 12-byte optimizer shard alone is 103 GB a GPU); with the optimizer offloaded
    it does (1.1 TB of the host's 2 TB), at the cost of the host's step."""
    d = {"name": "70b-8gpu", "cluster": {"topology": "topologies/dgx-h100.yaml", "nodes": 1},
         "model": {"name": "llama2-70b", "layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
                   "ffn_hidden": 28672, "mlp": "swiglu", "norm": "rmsnorm", "bias": False, "dropout": False,
                   "vocab": 32000, "seq_len": 4096, "tied_embeddings": False, "position_embedding": "rope"},
         "parallel": {"tp": 1, "pp": 1, "dp": 8, "zero": 3},
         "training": {"global_batch_size": 8, "recompute": "full"}}
    assert not memory_floor(clustersim.load_scenario(d))["fits"]
    d["training"]["optimizer_offload"] = 1.0
    r = clustersim.simulate(clustersim.load_scenario(d))
    assert r.summary["memory"]["fits"] and r.summary["memory"]["host"]["peak_bytes"] > 1e12
    assert r.summary["exposed_comm_s"]["offload"] > 0


def test_the_collapse_gives_every_rank_s_figures():
    """PP2 x DP8 with ZeRO-2 and half the optimizer offloaded, pipelined: the symmetric
    collapse's summary figures equal every rank's."""
    a = clustersim.simulate(_scenario(0.5, True, zero=2, pp=2, dp=8)).summary
    b = clustersim.simulate(_scenario(0.5, True, zero=2, pp=2, dp=8, collapse=False)).summary
    for k in ("step_time_s", "compute_s", "bubble_fraction"):
        assert a[k] == pytest.approx(b[k], rel=1e-9)
    assert a["exposed_comm_s"] == pytest.approx(b["exposed_comm_s"], rel=1e-9)
    assert a["memory"]["host"] == pytest.approx(b["memory"]["host"], rel=1e-12)


def test_what_offload_refuses_and_what_it_ignores():
    """A sharded optimizer only, fp32 moments only (Megatron-LM's HybridDeviceOptimizer); the
    copies' overlap with nothing offloaded is ignored, as Megatron-LM ignores it (a sweep over
    the share keeps its baseline)."""
    with pytest.raises(ConfigError) as e:
        _scenario(1.0, zero=0)
    assert e.value.field == "training.optimizer_offload" and "parallel.zero=0 keeps them whole" in str(e.value)
    d = scenario_dict(cluster={"topology": "topologies/dgx-a100.yaml", "nodes": 2},
                      parallel={"tp": 1, "pp": 1, "dp": 16, "zero": 1},
                      training={"global_batch_size": 16, "optimizer_offload": 0.5, "optimizer_moments_dtype": "bf16"})
    with pytest.raises(ConfigError) as e:
        clustersim.load_scenario(d, base_dir=ROOT)
    assert e.value.field == "training.optimizer_moments_dtype" and "keeps fp32 moments" in str(e.value)
    base, ignored = _scenario(0.0), _scenario(0.0, True)
    assert clustersim.simulate(ignored).summary["step_time_s"] == clustersim.simulate(base).summary["step_time_s"]


def test_a_topology_without_a_host_is_named():
    d = scenario_dict(cluster={"topology": "topologies/fat-tree.yaml", "nodes": 2},
                      parallel={"tp": 1, "pp": 1, "dp": 16, "zero": 1},
                      training={"global_batch_size": 16, "optimizer_offload": 0.5})
    with pytest.raises(ConfigError) as e:
        clustersim.load_scenario(d, base_dir=ROOT)
    assert e.value.field == "training.optimizer_offload"
    assert "topologies/fat-tree.yaml has no node.host" in str(e.value)
    d["cluster"]["node"] = {"host": HOST}  # given in the scenario instead
    assert clustersim.load_scenario(d, base_dir=ROOT).topology.node.host.copy_GBps == HOST["copy_GBps"]
    d["cluster"]["node"] = {"host": {"memory_GB": 512}}  # in part: the key missing beside it is named
    with pytest.raises(ConfigError) as e:
        clustersim.load_scenario(d, base_dir=ROOT)
    assert e.value.field in ("cluster.node.host.memory_GBps", "cluster.node.host.copy_GBps")
    assert "required key is missing" in str(e.value) and "cluster.node.host.memory_GB=512" in str(e.value)
    d["cluster"] = {"topology": "topologies/dgx-a100.yaml", "nodes": 2, "node": {"host": None}}  # one removed
    with pytest.raises(ConfigError) as e:
        clustersim.load_scenario(d, base_dir=ROOT)
    assert "the scenario's cluster.node.host: null removes the topology's" in str(e.value)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_whose_cycle_is_copied_in_offloads_as_one_simulated_whole(overlap):
    """256 microbatches a pipeline: the shorter step's cycle copied in (engine.repeat) and the
    optimizer offloaded after it give the step simulated whole."""
    d = scenario_dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 2},
                      parallel={"tp": 2, "pp": 4, "dp": 2, "zero": 1}, model={"layers": 16},
                      training={"global_batch_size": 1024, "optimizer_offload": 0.7, "overlap_offload_copies": overlap})
    a = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT), repeat=True).summary
    b = clustersim.simulate(clustersim.load_scenario(d, base_dir=ROOT), repeat=False).summary
    assert a["simulation"]["repeat"] is not None
    assert a["step_time_s"] == pytest.approx(b["step_time_s"], rel=1e-9)
    assert a["exposed_comm_s"]["offload"] == pytest.approx(b["exposed_comm_s"]["offload"], rel=1e-9)
    assert a["exposed_comm_s"]["offload"] > 0


def test_sweep_and_validate_say_it_is_the_host_that_does_not_fit(tmp_path):
    """Every GPU fits and the host does not: sweep's fits cell says "NO: host", a plan left out
    by its floor is said to need host memory, and validate gives both floors."""
    from clustersim.sweep import fits_text, unfit_reason

    from .test_cli import run_cli

    sc = _scenario(1.0)
    need = 8 * 16 * _shard(sc)
    small = _scenario(1.0, host={**HOST, "memory_GB": need / GB * 0.9})
    floor = memory_floor(small)
    assert floor["peak_bytes"] <= floor["capacity_bytes"] and not floor["host"]["fits"]
    assert unfit_reason(floor).startswith("needs ") and "GiB of host memory on node 0" in unfit_reason(floor)
    m = clustersim.simulate(small).summary["memory"]
    row = {"fits": m["fits"], "host_fits": m["host"]["fits"], "peak_bytes": m["peak_bytes"],
           "capacity_bytes": m["capacity_bytes"]}
    assert fits_text(row) == "NO: host"
    assert fits_text({**row, "peak_bytes": 2 * m["capacity_bytes"]}) == "NO"
    out = run_cli("validate", str(ROOT / "scenarios/offload_llama2_70b_8gpu.yaml"))
    assert out.returncode == 0 and "1,027.9 of 1,907 GiB of host memory a node)" in out.stdout


@pytest.mark.parametrize("overlap", [False, True])
def test_the_experts_optimizer_follows_the_dense_one(overlap):
    """MoE: Megatron-LM's ChainedOptimizer steps the dense and the routed experts' instances in
    turn; the experts' copies down start once the dense host steps are done and, on one stream
    without the overlap, once the dense copies up are. Each instance's GPU Adam over the share
    it keeps, its host step and its copies hold its own parameters."""
    from .test_symmetry import MOE

    d = scenario_dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 2},
                      parallel={"tp": 2, "pp": 2, "dp": 4, "ep": 4, "sp": True, "zero": 1}, model={"moe": MOE},
                      training={"global_batch_size": 16, "optimizer_offload": 0.5, "overlap_offload_copies": overlap})
    sc = clustersim.load_scenario(d, base_dir=ROOT)
    r = clustersim.simulate(sc)
    spans = [s for s in r.trace.spans if s.rank == r.trace.ranks[0] and s.phase == "opt"]
    by = {}
    for s in spans:
        by.setdefault(_piece_of(s.name), []).append(s)
    dense_done = max(s.end_s for s in by["host optimizer step"])
    dense_up = max(s.end_s for s in by["params from host"])
    first_expert = min(s.start_s for s in by["expert grads to host"])
    assert first_expert >= (dense_done if overlap else dense_up) - 1e-15
    w = lowering(sc, collapse=True).work[0]
    host = sc.topology.node.host
    expert = w.local_expert_params / sc.mesh.grad_shards(1)[1] * 0.5
    assert sum(s.end_s - s.start_s for s in by["host expert optimizer step"]) == pytest.approx(
        expert * (36 if overlap else 28) / (host.memory_GBps * GB / 8), rel=1e-9)
    assert by["expert optimizer step"][0].end_s - by["expert optimizer step"][0].start_s == pytest.approx(
        adam_step_time_s(expert, sc.cluster.gpu), rel=1e-12)
    ag = min(s.start_s for s in r.trace.spans if s.rank == r.trace.ranks[0] and s.name.startswith("AG"))
    assert ag >= max(s.end_s for s in by["expert params from host"]) - 1e-15


def test_the_report_and_the_terminal_show_the_host():
    """The report names the offload in the step's breakdown, draws its streams under one legend
    entry and gives the host's memory; a host too small is named on the step line and card."""
    from clustersim.output.report import build_figure, report_html
    from clustersim.output.summary import format_summary

    r = clustersim.simulate(_scenario(1.0, True))
    page = report_html(r.trace, r.summary, build_figure(r.trace, r.summary))
    assert "exposed communication and offload" in page and "offload to the host (copies, its Adam)" in page
    assert "Host memory (offload)" in page and "fits" in page
    text = format_summary(r.summary)
    assert "offload" in text.split("exposed comm", 1)[1].split("\n", 1)[0]
    assert "host memory" in text and "DOES NOT FIT" not in text
    need = 8 * 16 * _shard(_scenario(1.0))
    small = clustersim.simulate(_scenario(1.0, host={**HOST, "memory_GB": need / GB * 0.9}))
    assert "(DOES NOT FIT in host memory: " in format_summary(small.summary)
    page = report_html(small.trace, small.summary, build_figure(small.trace, small.summary))
    assert "the plan does not fit in host memory" in page and "fits; the host's memory does not" in page


# activation offload (training.activation_offload_layers): Megatron-LM's layer-level CPU offload


def _act_scenario(n: int, *, copy_GBps: float = 52.0, memory_GBps: float = 450.0, collapse: bool = True,
                  network: str = "flow", **training) -> clustersim.Scenario:
    """8 layers of the small model at 4K tokens, TP2 x DP4 on one DGX H100 node, the first
    ``n`` layers' activations offloaded (the host's copies at ``copy_GBps``)."""
    host = {"memory_GB": 2048, "memory_GBps": memory_GBps, "copy_GBps": copy_GBps}
    d = scenario_dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 1, "node": {"host": host}},
                      parallel={"tp": 2, "pp": 1, "dp": 4, "zero": 1, "sp": True}, model={"layers": 8, "seq_len": 4096},
                      training={"global_batch_size": 8, "activation_offload_layers": n, **training},
                      simulation={"collapse_symmetric": collapse, "network": network})
    return clustersim.load_scenario(d, base_dir=ROOT)


def test_offloaded_layers_leave_the_gpu_and_wait_in_the_host():
    """Each offloaded layer's activations (what it keeps for its backward, Korthikanti's terms)
    leave the GPU's peak and take its place in the host's memory, one microbatch's at a time."""
    from clustersim.model import transformer as tf

    base = clustersim.simulate(_act_scenario(0)).summary["memory"]
    sc = _act_scenario(3)
    m, t = sc.model, sc.training
    layer = tf.layer_activation_bytes(m, t.micro_batch_size, 2, True, True, "none")
    mem = clustersim.simulate(sc).summary["memory"]
    st, st0 = mem["stages"][0], base["stages"][0]
    assert st0["activations_bytes"] - st["activations_bytes"] == pytest.approx(3 * layer, rel=1e-12)
    assert st["host_bytes"] == pytest.approx(3 * layer, rel=1e-12) and base["host"] is None
    assert mem["host"]["peak_bytes"] == pytest.approx(8 * 3 * layer, rel=1e-12)
    # each copy's span carries its layer's bytes (the trace's, beside its layer and microbatch)
    r = clustersim.simulate(sc)
    copies = [s for s in r.trace.spans if s.name in ("activations to host", "activations from host")]
    assert copies and all(s.size_bytes == pytest.approx(layer, rel=1e-12) for s in copies)
    assert {s.layer for s in copies} == {0, 1, 2}


def test_the_copies_follow_transformer_engines_window():
    """N = 3 of L = 8 layers offloaded, w = L - N = 5 resident: layer i's copy down starts when
    its forward ends and the forward of layer w + i waits for it; its copy up starts when the
    backward of layer w - 1 + i starts, and its backward waits for it. Each copy moves the
    layer's bytes at the host's copy rate."""
    r = clustersim.simulate(_act_scenario(3, copy_GBps=5.0))
    rank = r.trace.ranks[0]
    mine = [s for s in r.trace.spans if s.rank == rank and s.mb == 0]
    layer = next(x for ly, x, _ in lowering(_act_scenario(3), collapse=True).work[0].offload_acts if ly == 0)

    def f_layer(ly, first):  # (its first task: the SP gather before its attention)
        xs = [s for s in mine if s.kind in ("compute", "tp") and s.phase == "F" and s.layer == ly]
        return min(xs, key=lambda s: s.start_s) if first else max(xs, key=lambda s: s.end_s)

    def b_first(ly, compute=True):  # (the backward of a layer begins with its SP gather, before its compute)
        return min((s for s in mine if (s.kind == "compute" or not compute and s.kind == "tp") and s.phase == "B"
                    and s.layer == ly), key=lambda s: s.start_s)

    downs = {s.layer: s for s in mine if s.name == "activations to host"}
    ups = {s.layer: s for s in mine if s.name == "activations from host"}
    assert sorted(downs) == sorted(ups) == [0, 1, 2]
    for i in range(3):
        last_f = max((s for s in mine if s.kind == "compute" and s.phase == "F" and s.layer == i), key=lambda s: s.end_s)
        assert downs[i].start_s == pytest.approx(max(last_f.end_s, downs[i - 1].end_s if i else 0.0))
        assert downs[i].end_s - downs[i].start_s == pytest.approx(layer / 5e9, rel=1e-12)
        assert f_layer(5 + i, True).start_s >= downs[i].end_s - 1e-15
        assert ups[i].start_s >= b_first(4 + i, compute=False).start_s - 1e-15
        assert b_first(i).start_s >= ups[i].end_s - 1e-15
    assert f_layer(5, True).start_s == pytest.approx(downs[0].end_s)  # (the copy is slower than a layer here)


def test_fast_copies_hide_and_slow_ones_do_not():
    """Copies faster than the layers they run beside cost the step nothing (exactly, with the
    network ideal; on the flow network the copies' events reorder this plan's TP and DP
    transfers sharing NVLink, 0.2 % of its step); slow ones make the GPU wait (exposed
    offload), and the compute stays what it was."""
    base = clustersim.simulate(_act_scenario(0)).summary
    fast = clustersim.simulate(_act_scenario(3, copy_GBps=1e5, memory_GBps=1e6)).summary
    slow = clustersim.simulate(_act_scenario(3, copy_GBps=5.0)).summary
    assert fast["step_time_s"] == pytest.approx(base["step_time_s"], rel=5e-3)
    free = [clustersim.simulate(_act_scenario(n, copy_GBps=1e5, memory_GBps=1e6, network="ideal")).summary
            for n in (0, 3)]
    assert free[1]["step_time_s"] == free[0]["step_time_s"]
    assert slow["step_time_s"] > base["step_time_s"] and slow["exposed_comm_s"]["offload"] > 0
    assert slow["compute_s"] == pytest.approx(base["compute_s"], rel=1e-12)
    a = clustersim.simulate(_act_scenario(3, copy_GBps=5.0, collapse=False)).summary
    assert a["step_time_s"] == pytest.approx(slow["step_time_s"], rel=1e-9)
    assert a["exposed_comm_s"] == pytest.approx(slow["exposed_comm_s"], rel=1e-9)


@pytest.mark.parametrize("change, message", [
    ({"parallel": {"pp": 2, "dp": 2}}, "Megatron-LM has no CPU offloading with pipeline parallelism"),
    ({"training": {"recompute": "full"}}, "recompute full does not go with it"),
    ({"training": {"activation_offload_layers": 8}}, "8 layers of model.layers=8: at most 7"),
    ({"parallel": {"schedule": "gpipe"}}, "schedule gpipe holds several microbatches"),
    ({"cluster": {"topology": "topologies/fat-tree.yaml", "nodes": 1}}, "has no node.host"),
])
def test_what_activation_offload_refuses(change, message):
    d = scenario_dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 1},
                      parallel={"tp": 2, "pp": 1, "dp": 4, "zero": 1, "sp": True}, model={"layers": 8},
                      training={"global_batch_size": 8, "activation_offload_layers": 3})
    for k, v in change.items():
        d[k] = {**d[k], **v} if k != "cluster" else v
    with pytest.raises(ConfigError) as e:
        clustersim.load_scenario(d, base_dir=ROOT)
    assert e.value.field == "training.activation_offload_layers" and message in str(e.value)


def test_the_resident_window_is_the_heaviest_run_of_layers():
    """Transformer Engine keeps L - N consecutive layers resident, not the non-offloaded ones:
    with dense layers first (each keeping more than a MoE layer here), the backward's window,
    the early layers reloaded beside later ones, holds the most. The peak counts the heaviest
    window of L - N layers (plus the head's logits)."""
    from clustersim.model import transformer as tf

    from .test_symmetry import MOE

    moe = {**MOE, "top_k": 1, "layer_freq": [0, 0, 0, 1, 1, 1, 1, 1]}
    host = {"memory_GB": 2048, "memory_GBps": 450, "copy_GBps": 52}
    d = scenario_dict(cluster={"topology": "topologies/dgx-h100.yaml", "nodes": 1, "node": {"host": host}},
                      parallel={"tp": 1, "pp": 1, "dp": 8, "ep": 4, "zero": 1},
                      model={"layers": 8, "seq_len": 4096, "ffn_hidden": 16384, "moe": moe},
                      training={"global_batch_size": 8, "activation_offload_layers": 3})
    sc = clustersim.load_scenario(d, base_dir=ROOT)
    m, b = sc.model, sc.training.micro_batch_size
    per = [tf.layer_activation_bytes(m, b, 1, True, False, "none", m.is_moe_layer(ly)) for ly in range(8)]
    assert per[0] > per[7]  # (the dense layers keep more)
    w = lowering(sc, collapse=True).work[0]
    head = tf.head_activation_bytes(m, b, 1)
    heaviest = max(sum(per[j:j + 5]) for j in range(4))
    assert w.activation_bytes_per_mb == pytest.approx(heaviest + head, rel=1e-12)
    assert heaviest > sum(per[3:])  # (more than the five layers never offloaded)
