"""clustersim from Python, as a notebook uses it: a Scenario is read-only once loaded (a field
set afterwards simulated the plan it had, with twice the tokens/s), a changed plan comes from
``load_variant`` in any of the forms the docs give, the dotted names the docs write resolve
after ``import clustersim``, and arguments of the wrong type are refused with a TypeError
naming them instead of being read as something else ("False" as true) or failing deep inside."""

from __future__ import annotations

import pytest

import clustersim

from .conftest import ROOT

LLAMA3_8B = str(ROOT / "scenarios" / "llama3_8b_8gpu.yaml")


def test_a_scenario_is_read_only_once_loaded():
    sc = clustersim.load_scenario(LLAMA3_8B)
    _ = sc.mesh  # (worked out and kept: what a field set afterwards would not change)
    for name in ("cfg", "topology", "source", "schedule_text"):
        with pytest.raises(AttributeError, match=f"read-only once loaded \\(its {name} is set.*load_variant"):
            setattr(sc, name, getattr(sc, name))


def test_a_scenario_takes_no_new_attribute_and_its_sections_are_frozen():
    """A mistyped field (``sc.paralel``) was taken silently as a new attribute; a section's
    field raises pydantic's frozen-instance error, a ValueError, as the docs say."""
    sc = clustersim.load_scenario(LLAMA3_8B)
    with pytest.raises(AttributeError, match="has no field paralel, and is read-only once loaded.*load_variant"):
        sc.paralel = {"tp": 8}
    with pytest.raises(ValueError, match="frozen"):
        sc.parallel.tp = 8
    assert sc.parallel.tp == 4 and "paralel" not in vars(sc)


def test_a_scenario_files_text_is_refused_as_such():
    """The file's text given for its path named the whole text as a missing file."""
    with open(LLAMA3_8B) as f:
        text = f.read()
    with pytest.raises(TypeError, match="not the file's text: give the path, or load_scenario\\(yaml.safe_load"):
        clustersim.load_scenario(text)


def test_a_result_prints_as_one_line():
    """A notebook cell ending in a result (or its trace) printed every span: megabytes."""
    r = clustersim.simulate(LLAMA3_8B)
    s = r.summary
    assert repr(r) == (f"Result('llama3-8b-8gpu': step {s['step_time_s']:.4g} s, {s['tokens_per_s']:,.0f} tokens/s, "
                       f"MFU {100 * s['mfu']:.1f} %; {r.trace!r}; .summary, .trace, .figure())")
    assert repr(r.trace) == (f"Trace({r.trace.n_spans:,} spans of 1 simulated rank for 8 GPUs, "
                             f"ending at {r.trace.end_s:.4g} s)")
    assert r.trace.n_spans > 1000 and len(repr(r)) < 300


def test_a_changed_plan_is_load_variant_in_every_form_the_docs_give():
    made = [clustersim.load_variant(LLAMA3_8B, changes) for changes in
            ([("parallel.tp", 8), ("parallel.dp", 1)], {"parallel.tp": 8, "parallel.dp": 1},
             "parallel.tp=8 parallel.dp=1")]
    assert {(sc.parallel.tp, sc.parallel.dp, sc.mesh.world_size, sc.source) for sc in made} == {
        (8, 1, 8, f"{LLAMA3_8B} with parallel.tp=8 parallel.dp=1")}
    with pytest.raises(clustersim.ConfigError, match="parallel.tp is changed twice"):  # (the last won, unsaid)
        clustersim.load_variant(LLAMA3_8B, [("parallel.tp", 8), ("parallel.tp", 2)])
    with pytest.raises(TypeError, match="load_variant takes a scenario file's path, not dict"):
        clustersim.load_variant({"name": "x"}, {"parallel.tp": 8})
    for wrong in (5, "parallel.tp", [("parallel.tp",)], [(4, "parallel.tp")]):
        with pytest.raises((TypeError, clustersim.ConfigError), match="pairs|is not KEY=VALUE"):
            clustersim.load_variant(LLAMA3_8B, wrong)


def test_the_docs_dotted_names_resolve_after_import_clustersim():
    from clustersim.overrides import load_variant
    from clustersim.sweep import run_sweep

    assert clustersim.sweep.run_sweep is run_sweep and clustersim.load_variant is load_variant
    assert clustersim.overrides.load_variant is load_variant and hasattr(clustersim.api, "Elsewhere")
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        clustersim.no_such_thing


@pytest.mark.parametrize("name, value", [("collapse", "False"), ("repeat", "no"), ("repeat", 0), ("check", None),
                                         ("brief", 1)])
def test_simulate_refuses_a_flag_that_is_not_a_bool(name, value):
    with pytest.raises(TypeError, match=f"simulate's {name} is True or False.*not {value!r}"):
        clustersim.simulate(LLAMA3_8B, **{name: value})


@pytest.mark.parametrize("varies", [[("parallel.tp", 8)], {"parallel.tp": 8}, ["parallel.tp=4,8"]])
def test_run_sweep_refuses_varies_it_cannot_read(varies):
    from clustersim.sweep import run_sweep

    with pytest.raises(TypeError, match="run_sweep's varies are \\(key, values\\) pairs or a dict"):
        run_sweep(LLAMA3_8B, varies)


def test_run_sweep_refuses_what_the_command_line_refuses():
    """A value twice (two alike plans, ranked), no value (no plan, no error) or a key twice,
    from Python as from ``sweep --vary``: ConfigError naming them."""
    from clustersim.sweep import run_sweep

    for varies, says in (([("parallel.tp", [2, 2])], "parallel.tp: 2 is given twice"),
                         ({"parallel.tp": [2, 4.0, 4]}, "parallel.tp: 4 is given twice"),
                         ([("parallel.tp", [])], "parallel.tp has no values"),
                         ([("parallel.tp", [2]), ("parallel.tp", [4])], "parallel.tp is varied twice")):
        with pytest.raises(clustersim.ConfigError, match=says):
            run_sweep(LLAMA3_8B, varies)
