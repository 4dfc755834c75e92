"""The machine's memory: a run's tasks known before it is lowered, and a run too large for the
machine refused with what it would take, before anything is written."""

from __future__ import annotations

import pytest

import clustersim
import clustersim.host_memory as host_memory
from clustersim.api import simulate
from clustersim.errors import ConfigError
from clustersim.forking import WorkerSlots
from clustersim.program.lower import lower
from clustersim.program.tasks import Program

from .conftest import ROOT, scenario_dict
from .test_cli import run_cli, write_scenario
from .test_symmetry import COLLAPSE, MOE, _doc, _scenario

# a plan of each kind the collapse simulates differently: classes per stage, per CP index
# (unbalanced), per EP index (skewed load), per DP replica, split around stragglers and around a
# faulty cable
PARALLEL = {c[0]: c[2] for c in COLLAPSE}
CASES = {
    "interleaved-zero3": _doc("dgx-h100.yaml", 8, PARALLEL["interleaved-zero3"], 16, layers=16),
    "zb-h1-sp-zero2": _doc("dgx-h100.yaml", 8, PARALLEL["zb-h1-sp-zero2"], 16, layers=16),
    "dualpipe-zero1": _doc("dgx-h100.yaml", 8, PARALLEL["dualpipe-zero1"], 16, layers=16),
    "cp-ring-unbalanced": _doc("dgx-h100.yaml", 8, PARALLEL["cp-ring-unbalanced"], 4),
    "moe-ep4-strided-cp2": _doc("dgx-h100.yaml", 8, PARALLEL["moe-ep4-strided-cp2"], 4, moe=MOE),
    "moe-skewed-load": _doc("dgx-h100.yaml", 8, {"tp": 2, "pp": 2, "dp": 16, "ep": 4, "sp": True}, 4,
                            moe={**MOE, "ep_load": [2.0, 2 / 3, 2 / 3, 2 / 3]}),
    "two-stragglers": _doc("dgx-h100.yaml", 8, {"tp": 2, "pp": 4, "dp": 8}, 8,
                           what_if=[{"gpu": 13, "slowdown": 1.3}, {"gpu": 40, "slowdown": 1.1}]),
    "replicas": {**_doc("dgx-h100.yaml", 8, {"tp": 2, "pp": 4, "dp": 8}, 8), "simulation": {"split_replicas": True}},
    # (split around node 3's GPUs alone: around every GPU the cable reaches it is every rank)
    "nic-cable": {**_doc("dgx-h100.yaml", 8, {"tp": 2, "pp": 4, "dp": 8}, 8,
                         what_if=[{"link": "n3.nic2-leaf0.2", "bw_factor": 0.25}]),
                  "simulation": {"fabric_fault_split_ranks": 40}},
}


def _case(name: str) -> clustersim.Scenario:
    return clustersim.load_scenario(CASES[name], base_dir=ROOT)


@pytest.mark.parametrize("name", list(CASES))
def test_the_tasks_of_every_rank_are_counted_on_the_collapsed_program(name):
    """Each simulated rank's tasks times the ranks it stands for is the all-ranks lowering's
    count, wherever the classes split."""
    sc = _case(name)
    collapsed, _ = lower(sc, collapse=True)
    every, _ = lower(sc, collapse=False)
    assert len(collapsed.ranks) < len(every.ranks) == sc.mesh.world_size
    assert host_memory.rank_by_rank_tasks(collapsed) == len(every.items)
    assert host_memory.rank_by_rank_tasks(every) == len(every.items)  # (every weight is 1)


def test_each_simulated_rank_counts_as_many_times_as_the_ranks_it_stands_for():
    """Classes of unequal size with unequal programs (the plans above split every stage
    alike, where an average per simulated rank would do as well): 2 x 3 + 4 x 1."""
    prog = Program(ranks=[0, 5], weight={0: 3, 5: 1})
    for rank in (0, 0, 5, 5, 5, 5):
        prog.add(rank=rank, stream="compute", name="F", kind="compute")
    assert host_memory.rank_by_rank_tasks(prog) == 10


def _little_memory(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(host_memory, "available_bytes", lambda: int(gib * 2**30))


def test_a_run_every_rank_of_which_would_not_fit_is_refused_before_it_is_lowered(monkeypatch):
    sc = _scenario(32, {"tp": 8, "pp": 4, "dp": 8}, layers=32, training={"global_batch_size": 4096})
    lowered = []
    monkeypatch.setattr("clustersim.api.lower_step", lambda *a, **k: lowered.append(a) or pytest.fail("lowered"))
    _little_memory(monkeypatch, 1.0)
    with pytest.raises(ConfigError) as exc:
        simulate(sc, collapse=False)
    tasks = host_memory.rank_by_rank_tasks(lower(sc, collapse=True)[0])
    need_gib = host_memory.run_bytes(tasks, 256) / 2**30
    assert need_gib > 1.0
    assert exc.value.field == "collapse=False"
    assert exc.value.message.startswith(f"simulating every one of the 256 ranks: {tasks:,} tasks on 256 GPUs, "
                                        f"about {need_gib:.1f} GiB of memory")
    assert "this machine has 1.0 GiB available" in exc.value.message
    # the same plan collapsed is small enough not to ask the machine at all
    assert host_memory.run_bytes(len(lower(sc)[0].items), 256) < host_memory.UNWEIGHED_BYTES


def test_a_collapsed_step_that_would_not_fit_names_its_microbatches(monkeypatch):
    sc = _scenario(32, {"tp": 8, "pp": 4, "dp": 8}, layers=32, training={"global_batch_size": 4096})
    tasks = len(lower(sc)[0].items)
    _little_memory(monkeypatch, (host_memory.run_bytes(tasks, 256) - 1) / 2**30)
    monkeypatch.setattr(host_memory, "UNWEIGHED_BYTES", 0)
    with pytest.raises(ConfigError) as exc:
        simulate(sc)
    assert exc.value.field == "training.global_batch_size"
    assert exc.value.message.startswith(f"the step of 512 microbatches: {tasks:,} tasks on 256 GPUs")
    _little_memory(monkeypatch, host_memory.run_bytes(tasks, 256) / 2**30)
    assert simulate(sc).summary["step_time_s"] > 0  # just enough


def test_a_cluster_too_large_for_the_machine_is_named(monkeypatch):
    """A collapsed run's memory grows with the cluster's GPUs too (their routes, the orbit
    plans of collectives over thousands of replicas): 16,384 GPUs expect 16 KB each, far more
    than the step's few thousand tasks, so the refusal names the nodes, and the machine's
    memory is asked before the engine is set up."""
    sc = clustersim.load_scenario(_doc("dgx-h100.yaml", 2048, {"tp": 8, "pp": 2, "dp": 1024}, 4), base_dir=ROOT)
    tasks = len(lower(sc)[0].items)
    need = host_memory.run_bytes(tasks, 16_384)
    assert need > host_memory.RUN_BASE_BYTES + 16_384 * 16_000  # (the GPUs' share counted)
    assert host_memory.RUN_BYTES_PER_GPU * 16_384 > 10 * host_memory.RUN_BYTES_PER_TASK * tasks
    monkeypatch.setattr("clustersim.api.Engine", lambda *a, **k: pytest.fail("set up"))
    _little_memory(monkeypatch, (need - 1) / 2**30)
    monkeypatch.setattr(host_memory, "UNWEIGHED_BYTES", 0)
    with pytest.raises(ConfigError) as exc:
        simulate(sc)
    assert exc.value.field == "cluster.nodes"
    assert exc.value.message.startswith(f"a cluster of 16,384 GPUs: {tasks:,} tasks on 16,384 GPUs, about "
                                        f"{need / 2**30:.1f} GiB")
    assert "1.5 KB a task and 16 KB a GPU" in exc.value.message


@pytest.mark.parametrize("case, field, said", [
    ("two-stragglers", "cluster.what_if", "the what-ifs' split into 24 simulated ranks: "),
    ("moe-skewed-load", "model.moe.ep_load", "the skewed expert load's 8 simulated ranks: "),
    ("replicas", "simulation.split_replicas", "each DP replica apart, 32 simulated ranks: "),
])
def test_classes_too_many_for_the_machine_name_what_split_them(case, field, said, monkeypatch):
    sc = _case(case)
    monkeypatch.setattr(host_memory, "UNWEIGHED_BYTES", 0)
    _little_memory(monkeypatch, 0.1)
    with pytest.raises(ConfigError) as exc:
        simulate(sc)
    assert exc.value.field == field
    assert exc.value.message.startswith(said)


def test_all_ranks_of_16k_gpus_refused_on_the_command_line(tmp_path, root):
    """--all-ranks past the all-ranks limit gets the YAML setting's refusal, naming the flag
    (it was not refused: still running after a minute)."""
    r = run_cli("run", root / "bench/scenarios/llama3_405b_16k.yaml", "--all-ranks", "--out", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert "llama3_405b_16k.yaml: --all-ranks: simulating every one of 16,384 ranks would take hours" in r.stderr
    assert not (tmp_path / "out").exists()


def test_all_ranks_too_large_for_the_machine_refused_on_the_command_line(tmp_path, root, monkeypatch, capsys):
    from clustersim.cli import EXIT_BAD_INPUT, main

    monkeypatch.setattr(host_memory, "UNWEIGHED_BYTES", 0)
    _little_memory(monkeypatch, 0.01)
    sc = write_scenario(tmp_path, root, scenario_dict())
    out = tmp_path / "out"
    assert main(["run", str(sc), "--all-ranks", "--out", str(out)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith(f"error: {sc}: --all-ranks: simulating every one of the ") and "0.0 GiB available" in err
    assert not out.exists()


@pytest.mark.parametrize("version", [2, 1])
def test_a_containers_memory_limit_bounds_what_is_available(version, tmp_path, monkeypatch):
    """Inside a container the system's available memory is the host's: what is left under the
    cgroup's limit counts, its inactive page cache taken off the usage (reclaimed first)."""
    GiB = 2**30
    if version == 2:
        files = {"memory.max": f"{8 * GiB}\n", "memory.current": f"{5 * GiB}\n",
                 "memory.stat": f"anon {3 * GiB}\ninactive_file {2 * GiB}\nactive_file 0\n"}
    else:
        (tmp_path / "memory").mkdir()
        files = {"memory/memory.limit_in_bytes": f"{8 * GiB}\n", "memory/memory.usage_in_bytes": f"{5 * GiB}\n",
                 "memory/memory.stat": f"cache {2 * GiB}\ntotal_inactive_file {2 * GiB}\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", tmp_path)
    assert host_memory.cgroup_room_bytes() == 5 * GiB  # 8 - (5 - 2)
    assert host_memory.available_bytes() <= 5 * GiB
    # no limit: the system's figure alone
    (tmp_path / next(iter(files))).write_text("max\n" if version == 2 else "9223372036854771712\n")
    assert host_memory.cgroup_room_bytes() is None
    assert host_memory.available_bytes() > 0


def test_no_cgroup_files_no_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", tmp_path / "absent")
    assert host_memory.cgroup_room_bytes() is None


def _ledger_with_another_run(monkeypatch, held_bytes: int) -> WorkerSlots:
    """A search's ledger where another live process (pytest's parent) holds ``held_bytes``."""
    import os

    ledger = WorkerSlots(2)
    ledger.pids[0], ledger.values[0] = os.getppid(), held_bytes
    monkeypatch.setattr(host_memory, "_LEDGER", ledger)
    monkeypatch.setattr(host_memory, "UNWEIGHED_BYTES", 0)
    monkeypatch.setattr(host_memory, "LEDGER_POLL_S", 0.02)
    return ledger


def _weighed_within(seconds: float) -> float | None:
    """check_fits of a run of 1,000 tasks in a thread: the clock (``time.monotonic``) when it
    returned, None if it had not within ``seconds`` (a wait that never ends fails the test,
    not hangs it)."""
    import threading
    import time

    done: list[float] = []

    def weigh() -> None:
        host_memory.check_fits(1000, 0, "a run", "less", source=None, field=None)
        done.append(time.monotonic())

    th = threading.Thread(target=weigh, daemon=True)
    th.start()
    th.join(seconds)
    return done[0] if done else None


def test_a_search_workers_run_waits_while_another_holds_what_it_needs(monkeypatch):
    """A run that fits the machine alone but not beside another worker's waits for that run to
    end, then holds its own share (two such runs starting together both passed before)."""
    import os
    import threading
    import time

    need = host_memory.run_bytes(1000)
    ledger = _ledger_with_another_run(monkeypatch, need)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: int(1.5 * need))

    released: list[float] = []

    def other_run_ends() -> None:
        time.sleep(0.3)
        with ledger.lock:
            released.append(time.monotonic())
            ledger.set(os.getppid(), 0)

    threading.Thread(target=other_run_ends).start()
    done = _weighed_within(10)
    assert done is not None and done >= released[0]  # it returned only once the other run had ended
    assert dict(zip(ledger.pids, ledger.values)) == {os.getppid(): 0, os.getpid(): need}
    with host_memory.released():
        pass
    assert dict(zip(ledger.pids, ledger.values)) == {os.getppid(): 0, os.getpid(): 0}


def test_a_search_workers_run_too_large_even_alone_is_refused_at_once(monkeypatch):
    need = host_memory.run_bytes(1000)
    _ledger_with_another_run(monkeypatch, need // 4)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: need // 2)  # + the other's: still short
    with pytest.raises(ConfigError, match="this machine has"):
        host_memory.check_fits(1000, 0, "a run", "less", source=None, field=None)


def test_a_worker_that_ended_without_releasing_frees_its_share(monkeypatch):
    """A worker killed while it held its run's bytes (the pool replaces it) holds nothing: the
    run that waited for it goes on."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    need = host_memory.run_bytes(1000)
    ledger = _ledger_with_another_run(monkeypatch, need)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: int(1.5 * need))
    assert _weighed_within(0.5) is None  # (the live holder: it waits)
    ledger.pids[0] = gone.pid
    assert _weighed_within(5) is not None


@pytest.mark.parametrize("room", [1.5, 3.0])
def test_a_searchs_workers_run_large_plans_one_at_a_time(room, tmp_path, root, monkeypatch):
    """Two workers of a search, each plan weighed at ``need``, on a machine with ``room`` x
    ``need`` available: one at a time where two would not fit, together where they would."""
    import json
    import os
    import time

    from clustersim import api
    from clustersim.sweep import Plan, simulate_plans

    need = host_memory.run_bytes(1000)
    monkeypatch.setattr(host_memory, "UNWEIGHED_BYTES", 0)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: int(room * need))
    monkeypatch.setattr(host_memory, "LEDGER_POLL_S", 0.02)
    times = tmp_path / "times"
    times.mkdir()

    def simulate(sc, **_):  # (in a worker: weighed as a run of 1,000 tasks, then 0.4 s)
        host_memory.check_fits(1000, 0, "a run", "less", source=None, field=None)
        start = time.monotonic()
        time.sleep(0.4)
        (times / f"{start}-{os.getpid()}").write_text(json.dumps([start, time.monotonic(), os.getpid()]))
        raise ConfigError("timed")

    monkeypatch.setattr(api, "simulate", simulate)
    path = write_scenario(tmp_path, root, scenario_dict())
    rows: dict = {}
    plans = [Plan(n, []) for n in range(1, 5)]
    simulate_plans(str(path), clustersim.yamlio.read_yaml(path, what="scenario"), plans, rows, jobs=2)
    assert [r["reason"] for r in rows.values()] == ["timed"] * 4
    runs = sorted(json.loads(f.read_text()) for f in times.iterdir())
    if len({pid for _, _, pid in runs}) < 2:
        pytest.skip("one worker took every plan: nothing to tell")
    overlaps = sum(b0 < a1 for (_, a1, _), (b0, _, _) in zip(runs, runs[1:]))
    assert overlaps == 0 if room < 2 else overlaps > 0
