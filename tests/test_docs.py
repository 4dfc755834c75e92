"""The reference documentation names every input field and every output key.

docs/reference.md must mention, in backticks, the full dotted path of

* every field of the scenario format (``clustersim.config.ScenarioCfg``, e.g. ``parallel.tp``)
  and of the topology format (``clustersim.hardware.topology.TopologyCfg``, e.g.
  ``node.nvlink.bw_GBps``), found by walking the pydantic models;
* every key of a real summary.json, list items written with ``[]``
  (e.g. ``memory.stages[].peak_bytes``);
* every GPU of the catalogue and every alias, with the catalogue's figures in its table row.

A new field or output key without documentation fails here, which is the point.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pydantic
import pytest

import clustersim
from clustersim.config import ScenarioCfg
from clustersim.hardware.gpus import ALIASES, GPUS, GiB
from clustersim.hardware.topology import TopologyCfg

from .conftest import scenario_dict

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


@pytest.fixture(scope="module")
def reference_text() -> str:
    assert REFERENCE.is_file(), f"{REFERENCE} is missing"
    return REFERENCE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def backticked(reference_text) -> set[str]:
    """Every `code span` of the reference, as written."""
    return set(re.findall(r"`([^`\n]+)`", reference_text))


def _models_in(annotation) -> list[tuple[type[pydantic.BaseModel], bool]]:
    """BaseModel types inside an annotation, each with whether it sits in a list.

    Handles ``M``, ``M | None``, ``Optional[M]``, ``Union[A, B]``, ``list[M]``, ``tuple[M, ...]``
    and ``dict[str, M]`` (the latter two documented like lists, with ``[]``).
    """
    origin = typing.get_origin(annotation)
    # (under Python 3.10, list[M] is an instance of type too: only a class with no origin is one)
    if isinstance(annotation, type) and origin is None and issubclass(annotation, pydantic.BaseModel):
        return [(annotation, False)]
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [found for a in args for found in _models_in(a)]
    if origin in (list, tuple, set, frozenset, dict):
        inner = args[1:] if origin is dict else args
        return [(m, True) for a in inner if a is not Ellipsis for m, _ in _models_in(a)]
    return []


def field_paths(model: type[pydantic.BaseModel], prefix: str = "") -> list[str]:
    """Full dotted paths of every field of ``model``, nested sections included."""
    out = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        for sub, in_list in _models_in(info.annotation):
            out.extend(field_paths(sub, f"{path}[]." if in_list else f"{path}."))
    return list(dict.fromkeys(out))


def key_paths(obj, prefix: str = "") -> list[str]:
    """Every key path of a JSON-like value: ``a.b``, list items of dicts as ``a[].b``."""
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            out.append(path)
            out.extend(key_paths(v, path))
    elif isinstance(obj, list):
        for item in obj:
            if isinstance(item, (dict, list)):
                out.extend(key_paths(item, f"{prefix}[]"))
    return list(dict.fromkeys(out))


def test_walker_sees_nested_sections():
    scenario = field_paths(ScenarioCfg)
    topology = field_paths(TopologyCfg)
    assert {"cluster.topology", "model.kv_heads", "parallel.tp", "training.precision",
            "simulation.network"} <= set(scenario)
    assert {"gpu", "node.gpus", "node.nvlink.bw_GBps", "node.nic.bw_Gbps", "fabric.rail_optimized"} <= set(topology)


@pytest.mark.parametrize("model", [ScenarioCfg, TopologyCfg], ids=["scenario", "topology"])
def test_every_config_field_is_documented(model, backticked):
    missing = [p for p in field_paths(model) if p not in backticked]
    assert not missing, f"docs/reference.md does not document these {model.__name__} fields: {missing}"


@pytest.fixture(scope="module")
def summary():
    root = Path(__file__).resolve().parent.parent
    d = scenario_dict(parallel={"tp": 4, "pp": 2, "dp": 2}, training={"global_batch_size": 8})
    return clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary


def test_every_summary_key_is_documented(summary, backticked):
    paths = key_paths(summary)
    assert "memory.stages[].peak_bytes" in paths and "exposed_comm_s.tp" in paths  # the walker works
    missing = [p for p in paths if p not in backticked]
    assert not missing, f"docs/reference.md does not document these summary.json keys: {missing}"


def _fmt(x: float) -> str:
    return f"{x:g}"


def test_gpu_catalogue_table_matches_the_code(reference_text, backticked):
    rows = {}
    for line in reference_text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0].startswith("`") and cells[0].strip("`") in GPUS:
            rows[cells[0].strip("`")] = cells
    assert sorted(rows) == sorted(GPUS), "the GPU catalogue table must list every entry of GPUS once"
    for name, g in GPUS.items():
        want = [_fmt(g.bf16_flops / 1e12), "-" if g.fp8_flops is None else _fmt(g.fp8_flops / 1e12),
                _fmt(g.hbm_bw_Bps / 1e9), _fmt(g.hbm_capacity_bytes / GiB), _fmt(g.nvlink_bw_Bps / 1e9),
                _fmt(g.matmul_efficiency), _fmt(g.memory_efficiency),
                "-" if g.attention_efficiency is None else ", ".join(f"{e:.2f}" for e in g.attention_efficiency)]
        assert rows[name][1:9] == want, f"catalogue row of {name} is out of date"
    for alias, target in ALIASES.items():
        assert alias in backticked and target in backticked, f"alias {alias} -> {target} is not documented"


def _conditional_summaries() -> list[dict]:
    """Summaries with the sections and keys a plain run leaves out: faults and a straggler
    (what-ifs, fault splits), a repeating long step, optimizer offload (host memory, offload
    causes) and twins on other spines (asymmetric orbits)."""
    root = Path(__file__).resolve().parent.parent
    faults = scenario_dict(cluster={"topology": "topologies/dgx-a100.yaml", "nodes": 4,
                                    "what_if": [{"gpu": 3, "slowdown": 1.1},
                                                {"link": "n1.nic1-leaf0.1", "bw_factor": 0.5},
                                                {"link": "leaf0.0-spine0", "bw_factor": 0.5}]},
                           parallel={"tp": 4, "pp": 2, "dp": 4})
    long_step = scenario_dict(training={"global_batch_size": 320})
    return [clustersim.simulate(clustersim.load_scenario(faults, base_dir=root)).summary,
            clustersim.simulate(clustersim.load_scenario(long_step, base_dir=root)).summary,
            clustersim.simulate(root / "scenarios/offload_llama2_70b_8gpu.yaml").summary,
            clustersim.simulate(root / "scenarios/moe_1024gpu.yaml").summary]


def test_every_summary_key_of_the_conditional_sections_is_documented(backticked):
    """As above, on summaries that hold what a plain run leaves out: every key they hold is
    named in docs/reference.md too."""
    summaries = _conditional_summaries()
    s = summaries
    assert s[0]["hardware"]["what_if"] and s[1]["simulation"]["repeat"] and s[2]["memory"]["host"] \
        and s[3]["simulation"]["asymmetric_orbits"]  # (each holds what it is here for)
    paths = list(dict.fromkeys(p for summary in summaries for p in key_paths(summary)))
    missing = [p for p in paths if p not in backticked]
    assert not missing, f"docs/reference.md does not document these summary.json keys: {missing}"


def test_every_command_and_option_is_in_the_command_line_table(reference_text):
    """docs/reference.md's "Command line" names every command of ``clustersim`` and, in
    backticks, every option of each (its long form; ``-h`` aside), walked from the parser."""
    import argparse

    from clustersim.cli import build_parser

    section = reference_text[reference_text.index("\n## Command line"):]
    end = section.find("\n## ", 1)  # (to the next section: the Python API's table is no command's)
    section = section if end < 0 else section[:end]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z]+)[^`]*` \|.*$", section, re.M)}
    parser = build_parser()
    assert any("--version" in a.option_strings for a in parser._actions) and "`--version`" in section
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(rows) == sorted(commands.choices)
    for name, sub in commands.choices.items():
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help") and (option.startswith("--") or len(action.option_strings) == 1):
                    assert f"`{option}`" in rows[name], f"{name} {option}"


def test_the_python_api_table_gives_the_codes_signatures(reference_text):
    """docs/reference.md's "Python API" table: each function's signature as the code has it
    (its parameters, their defaults, which are keyword-only), so that a new option shows."""
    import inspect

    import clustersim
    from clustersim.advise import run_advise
    from clustersim.output.perfetto import write_trace
    from clustersim.output.report import write_report
    from clustersim.sweep import run_sweep

    section = reference_text[reference_text.index("\n## Python API"):]
    for f in (clustersim.load_scenario, clustersim.load_variant, clustersim.simulate, run_sweep, run_advise,
              write_report, write_trace):
        parts, star = [], False
        for p in inspect.signature(f).parameters.values():
            if p.kind is p.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
        assert f"`{f.__name__}({', '.join(parts)})`" in section, f.__name__
