"""Combined 1F1B (``parallel.ep_comm_overlap``, Megatron-LM's --overlap-moe-expert-parallel-comm):
steady-state forwards and backwards paired into overlapped chunks, each one's expert
all-to-alls under the other's compute."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.errors import ConfigError
from clustersim.output.summary import plan_line
from clustersim.schedule.classic import interleaved, interleaved_warmup, one_f_one_b
from clustersim.schedule.core import Action

from .conftest import ROOT, scenario_dict

MOE = {"moe": {"experts": 8, "top_k": 2, "expert_ffn": 512, "shared_experts": 1}, "mlp": "swiglu", "bias": False}


def _sc(pp: int = 1, overlap: bool = True, nodes: int = 2, **parallel) -> clustersim.Scenario:
    """A small MoE on ``nodes`` DGX A100 nodes, EP4 outside DP (``tp-cp-dp-ep-pp``: an EP group's
    four ranks on four nodes, or two), whose all-to-alls cross the NICs."""
    par = {"tp": 1, "pp": pp, "dp": 8 * nodes // pp, "ep": 4, "schedule": "interleaved" if pp > 1 else "1f1b",
           "ep_comm_overlap": overlap, "order": "tp-cp-dp-ep-pp", **parallel}
    if par["schedule"] == "interleaved":
        par.setdefault("vpp", 2)
    d = scenario_dict(cluster={"topology": "topologies/dgx-a100.yaml", "nodes": nodes}, model={"layers": 8, **MOE},
                      parallel=par, training={"global_batch_size": 4 * par["dp"]})
    return clustersim.load_scenario(d, base_dir=ROOT)


def test_without_a_pipeline_each_forward_pairs_with_the_backward_before_it():
    """Megatron-LM's combined_1f1b_schedule_for_no_pipelining: F0, then F(i+1) with B(i), then
    the last backward alone."""
    s = one_f_one_b(1, 5, combined=True)
    F, B = (lambda i: Action(0, "F", i)), (lambda i: Action(0, "B", i))
    assert list(s[0]) == [F(0), F(1), B(0), F(2), B(1), F(3), B(2), F(4), B(3), B(4)]
    assert s.fb_pairs[0] == tuple((F(i + 1), B(i)) for i in range(4))


@pytest.mark.parametrize("p, m, v, group", [(2, 4, 2, None), (4, 8, 2, None), (4, 16, 4, None), (4, 12, 3, 6),
                                            (8, 16, 2, None), (3, 7, 2, 7)])
def test_interleaved_warms_up_one_more_and_pairs_every_steady_forward(p, m, v, group):
    """Megatron-LM adds one warm-up forward under the overlap; the steady state is then F(w+k)
    B(k) pairs, each one chunk, never a backward with a forward of its own microbatch (which
    it waits on, at some stage, through the pipeline); the same actions as the plain
    schedule."""
    plain, combined = interleaved(p, m, v, group), interleaved(p, m, v, group, combined=True)
    for r in range(p):
        acts = combined[r]
        warm = min(interleaved_warmup(p, m, v, r, group) + 1, m * v)
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        assert first_b == (warm + 1 if warm < m * v else m * v)  # F(w) then B(0) opens the steady state
        assert sorted(acts) == sorted(plain[r])
        pairs = combined.fb_pairs[r]
        assert len(pairs) == m * v - warm
        assert all(f.mb != b.mb for f, b in pairs)
        paired = {a for pair in pairs for a in pair}
        assert [a for a in acts if a not in paired] == list(acts[:warm]) + list(acts[len(acts) - warm:])


def test_the_overlap_hides_expert_all_to_alls_without_changing_the_work():
    """EP4 across nodes without a pipeline: the same FLOPs and compute, the expert all-to-alls
    mostly hidden under the other microbatch's compute, a shorter step."""
    plain, combined = (clustersim.simulate(_sc(overlap=o)).summary for o in (False, True))
    assert combined["model_flops_per_step"] == pytest.approx(plain["model_flops_per_step"], rel=1e-12)
    assert combined["compute_s"] == pytest.approx(plain["compute_s"], rel=1e-9)
    assert combined["comm_s"]["ep"] == pytest.approx(plain["comm_s"]["ep"], rel=0.05)
    assert plain["exposed_comm_s"]["ep"] > 0.9 * plain["comm_s"]["ep"]  # blocking without the overlap
    assert combined["exposed_comm_s"]["ep"] < 0.5 * plain["exposed_comm_s"]["ep"]
    assert combined["step_time_s"] < plain["step_time_s"]
    assert combined["plan"]["ep_comm_overlap"] and "1f1b combined" in plan_line(combined)


@pytest.mark.parametrize("pp", [1, 2])
def test_one_more_microbatch_in_flight(pp):
    """The extra warm-up forward holds one more microbatch's activations on every rank."""
    plain, combined = (clustersim.simulate(_sc(pp, overlap=o)).summary["memory"]["stages"] for o in (False, True))
    for a, b in zip(plain, combined):
        assert b["inflight_microbatches"] == a["inflight_microbatches"] + 1
        assert b["activations_bytes"] == pytest.approx(a["activations_bytes"] + b["activation_bytes_per_microbatch"])


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_collapsed_equals_every_rank(pp):
    sc = _sc(pp, nodes=4)
    a, b = clustersim.simulate(sc).summary, clustersim.simulate(sc, collapse=False).summary
    assert a["step_time_s"] == pytest.approx(b["step_time_s"], rel=1e-9)
    for k in ("ep", "pp"):
        assert a["exposed_comm_s"][k] == pytest.approx(b["exposed_comm_s"][k], rel=1e-9, abs=1e-15)
    # (DP's exposed time is 0.012 % apart at pp=2 with or without the overlap: where the DP
    # reductions of EP's outer layout meet differs by a hair between a class and its members)
    assert a["exposed_comm_s"]["dp"] == pytest.approx(b["exposed_comm_s"]["dp"], rel=1e-3)


@pytest.mark.parametrize("model, parallel, training, message", [
    ({"moe": None}, {"ep": 1}, {}, "the model has no experts \\(model.moe\\): drop the setting"),
    ({}, {"ep": 1}, {}, "with parallel.ep=1 there are none: set ep > 1 or drop the setting"),
    ({"mtp_layers": 2}, {}, {}, "one multi-token prediction layer at most \\(model.mtp_layers=2\\)"),
    ({}, {"pp": 2, "dp": 8, "schedule": "1f1b"}, {}, "interleaved schedule only \\(schedule is 1f1b\\)"),
    ({}, {"pp": 2, "dp": 8, "schedule": "dualpipev"}, {}, "dualpipe and dualpipev overlap their own chunks"),
    ({}, {"schedule": "gpipe"}, {}, "without a pipeline the combined schedule is 1f1b's"),
    ({}, {}, {"recompute": "full"}, "does not go with training.recompute: full"),
    ({}, {}, {"recompute": "selective", "recompute_modules": ["moe"]}, "does not go with the moe module"),
])
def test_plans_megatron_refuses_are_refused(model, parallel, training, message):
    par = {"tp": 1, "pp": 1, "dp": 16, "ep": 4, "ep_comm_overlap": True, **parallel}
    d = scenario_dict(model={"layers": 8, **MOE, **model}, parallel=par,
                      training={"global_batch_size": 4 * par["dp"], **training})
    if d["model"]["moe"] is None:
        del d["model"]["moe"]
    with pytest.raises(ConfigError, match=f"parallel.ep_comm_overlap: .*{message}"):
        clustersim.load_scenario(d, base_dir=ROOT)
