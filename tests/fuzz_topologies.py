"""Property-based fuzzing of topology documents (shared by the CI test and the long run).

One of the shipped topologies (``topologies/*.yaml``) is mutated and written as YAML next to a
scenario that names it by a relative path (``../topo/t.yaml``); the scenario is then loaded
the way ``clustersim validate`` and ``run`` load it. Mutations:

* any field (or an unknown key) set to an awkward value: wrong types, zero, negative, NaN,
  infinities, huge numbers (2**63, 10**400), strings, lists, mappings, null, or removed;
* values that are plausible for the field: node and switch counts around the limits of the
  fabric (radix, tiers, oversubscription, nodes_per_leaf, leaves_per_pod, spines), GPU names;
* whole fat-tree fabrics: radix x tiers x oversubscription x counts;
* what-ifs in the topology and in the scenario: real and misspelt switch and cable names,
  every spine or every uplink of a leaf removed (GPUs cut off), malformed entries;
* a node count override from the scenario (``cluster.nodes``);
* YAML oddities: aliases (a billion-laughs bomb, an alias that contains itself), tags
  (``!!binary``, ``!!python/...``, ``!!set``), YAML 1.1 scalars (``0x10``, ``2:30``, ``yes``,
  ``.inf``), odd keys, duplicate keys, tabs, a cut-off or binary file, several documents, deep
  nesting, an empty or oversized file, a top level that is not a mapping.

Each example must end, within ``BOUND_S``, in a loaded scenario whose cluster builds (up to
``BUILD_MAX_GPUS``) with finite, positive figures, or in one ``ConfigError``: one line naming
the topology (or scenario) file and, unless the whole file is at fault, the field. Never another
exception, a hang or a MemoryError.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import signal
import threading
import time
from pathlib import Path

import yaml
from hypothesis import strategies as st

from clustersim.errors import ConfigError
from clustersim.hardware.gpus import ALIASES, GPUS
from clustersim.hardware.topology import TopologyCfg

from .conftest import ROOT, SMALL, shipped_topologies
from .fuzz_scenarios import mutate, values  # one way to edit a document by dotted paths
from .test_docs import field_paths

BOUND_S = 5.0  # wall time of one example: load, and build the cluster when it loaded
HANG_S = 60.0  # an example still running after this is stopped (and fails)
BUILD_MAX_GPUS = 4096  # a loaded scenario's cluster is built and routed up to this size
MAX_LINE = 600  # characters in an error line: long enough for any message, short of an echoed input

TOPOLOGIES = {p.name: yaml.safe_load(p.read_text()) for p in shipped_topologies(ROOT)}
PATHS = sorted(p for p in field_paths(TopologyCfg) if "[]" not in p) + [
    "fabric.no_such_key", "node.nic.speed", "nonsense"]
RAW = "RAWYAMLVALUE"  # a placeholder replaced by raw YAML text after dumping

# messages of errors about the whole file, which name no field
FILE_LEVEL = ("file is empty", "expected a mapping at the top level", "not a text file", "invalid YAML",
              "bytes; clustersim reads", "cannot read")

# ---------------------------------------------------------------------------------------------
# values

# the scenario fuzzer's values, plus numbers past any float
awkward = st.one_of(values, st.sampled_from([10**400, -(10**400)]))
counts = st.one_of(
    st.integers(min_value=1, max_value=300),
    st.sampled_from([1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 20, 31, 32, 33, 63, 64, 65, 72, 127, 128, 144, 192, 256,
                     257, 1000, 1024, 4096, 16384, 16385, 65536, 65537, 131072, 131073, 10**6, 10**9, 2**63,
                     10**400]),
)
ratios = st.one_of(
    st.sampled_from([0, 0.5, 0.999, 1, 1.0, 1.0001, 1.5, 2, 2.5, 3, 7, 31, 63, 64, 1e9, 1e300,
                     math.nan, math.inf, -math.inf, -1]),
    st.floats(min_value=0.5, max_value=100, allow_nan=False),
)
figures = st.one_of(  # bandwidths, latencies, efficiencies
    st.sampled_from([0, 1e-300, 1e-9, 0.5, 0.9, 1, 1.01, 32, 200, 400, 900, 1e6, 1e300, 1.7e308,
                     math.nan, math.inf, -1]),
    st.floats(min_value=0, max_value=1e4, allow_nan=False),
)
gpu_names = st.sampled_from([*GPUS, *ALIASES, "a100", "H100 ", "B300", "", "x" * 5000, "A100\n"])

TARGETED = {
    "nodes": counts, "node.gpus": counts, "node.nics": counts,
    "fabric.nodes_per_leaf": counts, "fabric.spines": counts, "fabric.radix": counts,
    "fabric.leaves_per_pod": counts, "fabric.tiers": st.sampled_from([1, 2, 3, 4, "3", 2.0, 3.5]),
    "fabric.kind": st.sampled_from(["leaf_spine", "fat_tree", "none", "clos", "Fat_Tree"]),
    "fabric.rail_optimized": st.sampled_from([True, False, "yes", 0, 1]),
    "fabric.oversubscription": ratios, "fabric.pod_oversubscription": ratios,
    "gpu": gpu_names,
}


def value_for(path: str):
    if path in TARGETED:
        return st.one_of(TARGETED[path], awkward)
    if path.endswith(("bw_GBps", "bw_Gbps", "latency_us", "efficiency", "pcie_GBps")):
        return st.one_of(figures, awkward)
    return awkward


field_changes = st.sampled_from(PATHS).flatmap(lambda p: st.tuples(st.just(p), value_for(p)))

# ---------------------------------------------------------------------------------------------
# fabrics and what-ifs

fat_trees = st.fixed_dictionaries(
    {"kind": st.just("fat_tree"), "radix": st.sampled_from([2, 3, 4, 5, 8, 16, 32, 63, 64, 65, 128, 144, 256,
                                                            4096, 65536, 65537]),
     "tiers": st.sampled_from([2, 3])},
    optional={"oversubscription": ratios, "pod_oversubscription": ratios, "rail_optimized": st.booleans(),
              "nodes_per_leaf": counts, "leaves_per_pod": counts, "latency_us": figures,
              "efficiency": figures})

small = st.integers(min_value=0, max_value=40)
switch_names = st.one_of(
    st.builds("leaf{}.{}".format, small, st.integers(0, 9)),
    st.builds("spine{}".format, small),
    st.builds("pod{}.spine{}".format, st.integers(0, 3), small),
    st.builds("core{}.{}".format, small, small),
    st.builds("n{}.{}".format, small, st.sampled_from(["nvsw", "gpu0", "nic0", "nic7", "gpu3"])),
    st.sampled_from(["", " ", "spine", "leaf-0", "x" * 3000, "spine0 ", "SPINE0"]),
)
cables = st.one_of(
    st.builds("{}-{}".format, switch_names, switch_names),
    st.builds("leaf{}.{}-spine{}".format, st.integers(0, 4), st.integers(0, 7), small),
    st.builds("n{}.nic{}-leaf{}.{}".format, st.integers(0, 3), st.integers(0, 7), st.integers(0, 1), st.integers(0, 7)),
    st.builds("pod{}.spine{}-core{}.{}".format, st.integers(0, 2), small, small, small),
    st.sampled_from(["-", "a-b-c", "leaf0.0", "n0.gpu0-n0.nvsw", "n0.gpu0-n0.nic0", "-" * 1000]),
)
entries = st.one_of(
    st.builds(lambda s: {"remove_switch": s}, switch_names),
    st.builds(lambda c: {"remove_link": c}, cables),
    st.builds(lambda c, f: {"link": c, "bw_factor": f}, cables, ratios),
    st.builds(lambda g, f: {"gpu": g, "slowdown": f}, st.one_of(st.integers(-2, 200), counts), ratios),
    st.sampled_from([{}, {"remove_switch": "spine0", "gpu": 1}, {"remove_spine": "spine0"}, "spine0", None, 3,
                     [{"remove_switch": "spine0"}], {"link": "leaf0.0-spine0"}, {"gpu": 0}]),
)
cut_offs = st.one_of(  # every spine gone, or every uplink of one leaf: GPUs cut off (or not quite)
    st.builds(lambda n: [{"remove_switch": f"spine{s}"} for s in range(n)], st.integers(1, 34)),
    st.builds(lambda n, r: [{"remove_link": f"leaf0.{r}-spine{s}"} for s in range(n)],
              st.integers(1, 34), st.integers(0, 7)),
    st.builds(lambda n: [{"remove_switch": f"leaf{g}.0"} for g in range(n)], st.integers(1, 8)),
    st.builds(lambda n: [{"remove_switch": f"pod0.spine{s}"} for s in range(n)], st.integers(1, 34)),
)
what_ifs = st.one_of(st.lists(entries, max_size=6), cut_offs)

# ---------------------------------------------------------------------------------------------
# YAML oddities: raw values for one field, and edits of the whole text

BOMB = ("[&a [x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b], "
        "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e,*e], "
        "&g [*f,*f,*f,*f,*f,*f,*f,*f,*f], &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]]")
raw_values = st.sampled_from([
    BOMB, "&r [*r]", "&r {kind: *r}", "&r {a: *r}", "0x10", "0o17", "2:30", "1_000", "yes", "no", "on", "~",
    ".inf", "-.inf", ".nan", "1e3", "!!binary aGVsbG8=", "!!python/object/apply:os.system ['true']",
    "!!set {a, b}", "!!omap [a: 1]", "!!timestamp 2020-01-01", "!!float 64", "!!str 64", "!!int '8'",
    '"\\x00"', '"\\uffff"', "'" + "9" * 500 + "'", "9" * 500, "[" * 40 + "]" * 40, "{a: {b: {c: {d: 1}}}}",
    "*undefined", "&x", "|\n  multi\n  line", "!custom 1",
])


def _text_edits():
    def nest(n):
        return lambda t: t + "nonsense: " + "[" * n + "]" * n + "\n"
    return st.sampled_from([
        ("duplicate key", lambda t: t + "nodes: 3\n"),
        ("tabs", lambda t: t.replace("  ", "\t")),
        ("several documents", lambda t: t + "---\nnodes: 2\n"),
        ("BOM", lambda t: "\ufeff" + t),
        ("CRLF", lambda t: t.replace("\n", "\r\n")),
        ("NUL", lambda t: t.replace("\n", "\n\x00", 1)),
        ("binary", lambda t: t.encode() + b"\xff\xfe\x00"),
        ("UTF-16", lambda t: t.encode("utf-16")),
        ("empty", lambda t: ""),
        ("comment only", lambda t: "# nothing here\n"),
        ("null", lambda t: "null\n"),
        ("list", lambda t: "- gpu: A100\n- nodes: 2\n"),
        ("scalar", lambda t: "just a string\n"),
        ("deep 50", nest(50)),
        ("deep 400", nest(400)),
        ("deep 5000", nest(5000)),
        ("deep block", lambda t: t + "nonsense:\n" + "- " * 20000 + "x\n"),
        ("oversized", lambda t: t + "# " + "x" * (65 * 1024) + "\n"),
        ("long flow list", lambda t: t + "nonsense: [" + "0," * (30 * 1024) + "0]\n"),
        ("unhashable key", lambda t: t + "? [a, b]\n: c\n"),
        ("odd keys", lambda t: t + "1: 2\nnull: 3\n"),
        ("unclosed", lambda t: t + "name: [a, b\n"),
        ("bad indent", lambda t: t + "   bogus: 1\n"),
    ])


def _cut(t: str, at: float) -> str:
    return t[:int(len(t) * at)]


text_edits = st.one_of(_text_edits(), st.builds(lambda at: ("cut off", lambda t: _cut(t, at)),
                                                st.floats(0, 1)))

# ---------------------------------------------------------------------------------------------
# a whole example


@st.composite
def examples(draw) -> dict:
    """A base topology and what is done to it; see :func:`check_one`."""
    ex = {"base": draw(st.sampled_from(sorted(TOPOLOGIES)))}
    ex["changes"] = draw(st.lists(field_changes, max_size=3))
    if draw(st.integers(0, 5)) == 0:
        ex["fabric"] = draw(fat_trees)
    if draw(st.booleans()):
        ex["what_if"] = draw(what_ifs)
    if draw(st.integers(0, 3)) == 0:
        ex["scenario_what_if"] = draw(what_ifs)
    if draw(st.integers(0, 2)) == 0:
        ex["nodes"] = draw(st.one_of(counts, st.sampled_from([0, -1, "2", 2.5, None])))
    if draw(st.integers(0, 5)) == 0:
        ex["raw"] = (draw(st.sampled_from(PATHS)), draw(raw_values))
    if draw(st.integers(0, 7)) == 0:
        ex["edit"] = draw(text_edits)
    ex["cli"] = draw(st.integers(0, 4)) == 0
    return ex


def topology_text(ex: dict) -> str | bytes:
    d = copy.deepcopy(TOPOLOGIES[ex["base"]])
    if "fabric" in ex:
        d["fabric"] = ex["fabric"]
    if "what_if" in ex:
        d["what_if"] = ex["what_if"]
    d = mutate(d, ex["changes"])
    if "raw" in ex:
        d = mutate(d, [(ex["raw"][0], RAW)])
    text = yaml.safe_dump(d, sort_keys=False, width=10**9)
    if "raw" in ex:
        text = text.replace(RAW, ex["raw"][1], 1)
    if "edit" in ex:
        text = ex["edit"][1](text)
    return text


def _world(ex: dict) -> int | None:
    """The world size the example's topology has, if its figures are plain integers."""
    d = mutate(TOPOLOGIES[ex["base"]], ex["changes"])
    nodes = ex.get("nodes") or (d.get("nodes", 1) if isinstance(d, dict) else None)
    node = d.get("node", {}) if isinstance(d, dict) else None
    gpus = node.get("gpus", 8) if isinstance(node, dict) else None
    if type(nodes) is int and type(gpus) is int and nodes >= 1 and gpus >= 1:
        return nodes * gpus
    return None


def scenario(ex: dict) -> dict:
    """A scenario naming the fuzzed topology; its plan fits the topology's GPUs when they are
    at most BUILD_MAX_GPUS (so that the topology is checked past the world size), else it is
    SMALL's 16 GPUs (and the world size check refuses it)."""
    sc = copy.deepcopy(SMALL)
    sc["cluster"] = {"topology": "../topo/t.yaml"}
    if "nodes" in ex:
        sc["cluster"]["nodes"] = ex["nodes"]
    if "scenario_what_if" in ex:
        sc["cluster"]["what_if"] = ex["scenario_what_if"]
    world = _world(ex)
    if world is not None and world <= BUILD_MAX_GPUS:
        sc["parallel"] = {"tp": 1, "pp": 1, "dp": world}
        sc["training"] = {"micro_batch_size": 1, "global_batch_size": world}
    return sc


class Hang(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise Hang after ``seconds`` (main thread on Unix only; elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def stop(*_):
        raise Hang(f"still running after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def check_one(ex: dict, workdir: Path) -> tuple[str, float]:
    """Run one example in ``workdir``; returns (its outcome, wall seconds)."""
    import clustersim
    from clustersim.cli import main

    topo_dir, scen_dir = workdir / "topo", workdir / "scen"
    topo_dir.mkdir(parents=True, exist_ok=True)
    scen_dir.mkdir(parents=True, exist_ok=True)
    text = topology_text(ex)
    topo_file = topo_dir / "t.yaml"
    if isinstance(text, bytes):
        topo_file.write_bytes(text)
    else:
        topo_file.write_text(text, encoding="utf-8", newline="")
    scen_file = scen_dir / "s.yaml"
    scen_file.write_text(yaml.safe_dump(scenario(ex), sort_keys=False))
    topo_source = str(scen_dir / "../topo/t.yaml")

    t0 = time.perf_counter()
    with _time_limit(HANG_S):
        if ex["cli"]:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(["validate", str(scen_file)])
            wall = time.perf_counter() - t0
            assert rc in (0, 2), rc
            if rc == 2:
                line = err.getvalue()
                assert line.count("\n") == 1 and line.startswith("error: ") and "Traceback" not in line, line
                assert line.startswith((f"error: {topo_source}: ", f"error: {scen_file}: ")), line
                outcome = "error"
            else:
                assert out.getvalue().startswith(f"{scen_file}: ok"), out.getvalue()
                outcome = "ok"
        else:
            try:
                sc = clustersim.load_scenario(scen_file)
            except ConfigError as exc:
                wall = time.perf_counter() - t0
                _check_error(exc, topo_source, str(scen_file))
                outcome = "error"
            else:
                _check_loaded(sc)
                wall = time.perf_counter() - t0
                outcome = "ok"
    assert wall < BOUND_S, f"took {wall:.1f} s (bound {BOUND_S:g} s)"
    return outcome, wall


def _check_error(exc: ConfigError, topo_source: str, scen_source: str) -> None:
    line = exc.line()
    assert "\n" not in line and len(line) <= MAX_LINE, line[:2000]
    assert exc.source in (topo_source, scen_source), line
    if exc.source == topo_source and not exc.field:
        assert any(m in exc.message for m in FILE_LEVEL), line
    if exc.source == scen_source:
        assert exc.field, line


def _check_loaded(sc) -> None:
    """A loaded scenario: the figures later stages read are sane, and (up to BUILD_MAX_GPUS)
    the cluster builds and routes between the first and the last GPU."""
    world = sc.mesh.world_size
    assert world == sc.topology.nodes * sc.topology.node.gpus >= 1
    if world > BUILD_MAX_GPUS:
        return
    cl = sc.cluster
    assert cl.num_gpus == world
    for e in range(len(cl.edges)):
        assert 0 < cl.edge_bw_Bps[e] < math.inf and 0 <= cl.edge_latency_s[e] < math.inf, cl.edges[e]
    for a, b in ((0, world - 1), (0, min(world - 1, sc.topology.node.gpus))):
        path = cl.path(a, b)
        assert math.isfinite(cl.path_latency_s(path))
        if path:
            assert 0 < cl.path_bw_Bps(path) < math.inf
