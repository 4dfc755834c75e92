"""Rank mesh, placement and layer splits."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.errors import ConfigError
from clustersim.plan.mesh import Mesh, parse_order, split_layers

from .conftest import scenario_dict


def test_tp_innermost_dp_then_pp():
    m = Mesh(tp=8, dp=4, pp=2)
    assert m.group(0, "tp") == tuple(range(8))  # one node of 8 GPUs
    assert m.group(0, "dp") == (0, 8, 16, 24)
    assert m.group(0, "pp") == (0, 32)
    assert m.coords(45) == {"tp": 5, "cp": 0, "dp": 1, "pp": 1}
    assert all(m.rank(**m.coords(r)) == r for r in range(m.world_size))
    assert len(m.groups("tp")) == 8 and len(m.groups("dp")) == 16 and len(m.groups("pp")) == 32


def test_other_orders():
    m = Mesh(tp=2, dp=2, pp=2, order=("tp", "pp", "dp"))
    assert m.group(0, "pp") == (0, 2) and m.group(0, "dp") == (0, 4)


def test_uneven_split_61_layers_16_stages():
    split = split_layers(61, 16)
    assert sum(split) == 61 and len(split) == 16 and max(split) - min(split) == 1
    assert split[0] == 4 and split[-1] == 3


def test_uneven_split_runs_end_to_end(root):
    d = scenario_dict(model={"layers": 7}, parallel={"tp": 2, "pp": 4, "dp": 2}, training={"global_batch_size": 8})
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary
    assert s["plan"]["layers_per_stage"] == [2, 2, 2, 1]
    acts = [st["activation_bytes_per_microbatch"] for st in s["memory"]["stages"]]
    assert acts[0] == acts[1] == acts[2] and acts[3] != acts[0]


def test_explicit_layers_per_stage(root):
    d = scenario_dict(model={"layers": 8}, parallel={"tp": 4, "pp": 2, "dp": 2, "layers_per_stage": [5, 3]})
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary
    assert s["plan"]["layers_per_stage"] == [5, 3]
    bad = scenario_dict(model={"layers": 8}, parallel={"tp": 4, "pp": 2, "dp": 2, "layers_per_stage": [5, 2]})
    with pytest.raises(ConfigError, match="parallel.layers_per_stage: .*sum to model.layers=8"):
        clustersim.load_scenario(bad, base_dir=root)


def test_microbatches_from_global_batch(root):
    sc = clustersim.load_scenario(scenario_dict(training={"global_batch_size": 24, "micro_batch_size": 3}),
                                  base_dir=root)
    assert sc.microbatches == 24 // (2 * 3)


def test_expert_groups_inside_dp():
    m = Mesh(tp=2, dp=8, pp=1, ep=4)
    r = m.rank(tp=1, dp=5, pp=0)
    assert [m.coords(x)["dp"] for x in m.group(r, "ep")] == [4, 5, 6, 7]
    assert [m.coords(x)["dp"] for x in m.group(r, "edp")] == [1, 5]
    assert all(m.coords(x)["tp"] == 1 for x in m.group(r, "ep") + m.group(r, "edp"))
    assert len(m.groups("ep")) == 2 * 2 and len(m.groups("edp")) == 2 * 4


def test_expert_groups_outside_dp():
    """ep after dp in the order: EP groups are strided DP indices, expert-DP groups consecutive."""
    m = Mesh(tp=1, dp=8, pp=1, ep=4, ep_inner=False)
    assert [m.coords(x)["dp"] for x in m.group(m.rank(dp=5), "ep")] == [1, 3, 5, 7]
    assert [m.coords(x)["dp"] for x in m.group(m.rank(dp=5), "edp")] == [4, 5]


def test_cp_sits_between_tp_and_dp_by_default():
    m = Mesh(tp=2, dp=2, pp=2, cp=2)
    assert m.order == ("tp", "cp", "dp", "pp")
    assert m.group(0, "cp") == (0, 2) and m.group(0, "dp") == (0, 4) and m.group(0, "pp") == (0, 8)
    # gradients go over dp x cp: every rank with the same TP and PP index, CP innermost
    assert m.group(1, "cp+dp") == (1, 3, 5, 7)
    assert sorted(x for g in m.groups("cp+dp") for x in g) == list(range(16))
    assert m.world_size == 16 and all(m.rank(**m.coords(r)) == r for r in range(16))


@pytest.mark.parametrize("order_text", ["tp-cp-dp-pp", "cp-tp-dp-pp", "tp-dp-cp-pp"])
def test_hierarchical_cp_cuts_each_cp_group_into_slices_and_rings(order_text):
    """cp_a2a=2 of cp=8: each CP group, in CP order, as slices of 2 consecutive members (cpa)
    and rings of the members at the same place in each (cpr); one rank's groups and the
    grid's agree, and every rank is in one of each."""
    order, _ = parse_order(order_text)
    m = Mesh(tp=2, dp=2, pp=1, cp=8, order=order, cp_a2a=2)
    assert m.size("cpa") == 2 and m.size("cpr") == 4
    for r in range(m.world_size):
        g = m.group(r, "cp")
        at = g.index(r)
        assert m.group(r, "cpa") == g[at // 2 * 2:at // 2 * 2 + 2]
        assert m.group(r, "cpr") == g[at % 2::2]
    for dim in ("cpa", "cpr"):
        gs = m.groups(dim)
        assert sorted(x for g in gs for x in g) == list(range(m.world_size))
        assert all(m.group(x, dim) == g for g in gs for x in g)
    if order_text == "tp-cp-dp-pp":
        assert m.group(0, "cpa") == (0, 2) and m.group(0, "cpr") == (0, 4, 8, 12)


@pytest.mark.parametrize("text, dims, ep_inner", [
    ("tp-dp-pp", ("tp", "cp", "dp", "pp"), True),
    ("tp-cp-ep-dp-pp", ("tp", "cp", "dp", "pp"), True),
    ("tp-cp-dp-ep-pp", ("tp", "cp", "dp", "pp"), False),
    ("cp-tp-pp-dp", ("cp", "tp", "pp", "dp"), True),
])
def test_parse_order(text, dims, ep_inner):
    assert parse_order(text) == (dims, ep_inner)


@pytest.mark.parametrize("text, why", [
    ("tp-dp", "missing pp"),
    ("tp-dp-pp-tp", "'tp' appears twice"),
    ("tp-ep-cp-dp-pp", "ep is carved out of dp, so it must sit next to dp"),
    # the places offered keep the user's order, and so does the order without ep
    ("dp-tp-cp-ep-pp", r"next to dp \(ep-dp-tp-cp-pp or dp-ep-tp-cp-pp; without expert parallelism leave ep "
                       r"out: dp-tp-cp-pp\)"),
    ("tp-xp-dp-pp", "unknown dimension 'xp'"),
])
def test_bad_orders_say_why(root, text, why):
    with pytest.raises(ConfigError, match=f"parallel.order: .*{why}"):
        clustersim.load_scenario(scenario_dict(parallel={"order": text}), base_dir=root)


@pytest.mark.parametrize("order_text", ["tp-cp-ep-dp-pp", "tp-cp-dp-ep-pp", "dp-tp-pp", "pp-dp-tp", "tp-pp-ep-dp"])
@pytest.mark.parametrize("tp,cp,dp,pp,ep", [(2, 1, 4, 3, 2), (4, 2, 8, 1, 4), (1, 2, 8, 2, 8), (2, 2, 2, 2, 1)])
def test_groups_on_the_grid_equal_each_ranks_group(order_text, tp, cp, dp, pp, ep):
    """Mesh.groups works on the whole rank grid at once; each group is exactly group(r, dim)
    of its members, every rank is in one group, and groups come ordered by their first rank."""
    order, inner = parse_order(order_text)
    m = Mesh(tp=tp, dp=dp, pp=pp, order=order, ep=ep, cp=cp, ep_inner=inner)
    for dim in ("tp", "cp", "dp", "pp", "ep", "edp", "cp+dp"):
        gs = m.groups(dim)
        assert sorted(r for g in gs for r in g) == list(range(m.world_size)), dim
        assert [min(g) for g in gs] == sorted(min(g) for g in gs)
        for g in gs:
            for r in g:
                assert m.group(r, dim) == g, (dim, r)


def test_the_schedule_check_left_to_the_caller(root):
    """load_scenario(check_schedule=False) builds no schedule; Scenario.check_schedule then
    raises what loading would have (the layer split against the schedule's parts), and checks
    a scenario once."""
    bad = scenario_dict(model={"layers": 8}, parallel={"tp": 4, "pp": 2, "dp": 2, "layers_per_stage": [5, 2]})
    with pytest.raises(ConfigError) as at_load:
        clustersim.load_scenario(bad, base_dir=root)
    sc = clustersim.load_scenario(bad, base_dir=root, check_schedule=False)
    assert "schedule" not in sc.__dict__
    with pytest.raises(ConfigError) as later:
        sc.check_schedule()
    assert later.value.line() == at_load.value.line()
    good = clustersim.load_scenario(scenario_dict(), base_dir=root, check_schedule=False)
    good.check_schedule()
    assert "schedule" in good.__dict__
    del good.__dict__["schedule"]
    good.check_schedule()  # checked already: not built again
    assert "schedule" not in good.__dict__


def test_adamw_is_adam_in_memory_and_time(root):
    """AdamW's decoupled weight decay keeps Adam's states and makes the same pass."""
    adam = clustersim.simulate(clustersim.load_scenario(scenario_dict(), base_dir=root)).summary
    adamw = clustersim.simulate(clustersim.load_scenario(scenario_dict(training={"optimizer": "adamw"}),
                                                         base_dir=root)).summary
    assert adamw["step_time_s"] == adam["step_time_s"] and adamw["memory"] == adam["memory"]


def test_a_schedule_file_without_a_schedule_is_a_custom_schedule(root):
    import yaml

    d = yaml.safe_load((root / "scenarios" / "custom_schedule.yaml").read_text())
    named = clustersim.load_scenario(d, base_dir=root / "scenarios")
    del d["parallel"]["schedule"]
    alone = clustersim.load_scenario(d, base_dir=root / "scenarios")
    assert alone.parallel.schedule == named.parallel.schedule == "custom" and alone.parallel == named.parallel
    with pytest.raises(ConfigError, match="is read by schedule custom only"):
        clustersim.load_scenario({**d, "parallel": {**d["parallel"], "schedule": "1f1b"}}, base_dir=root / "scenarios")
