"""Written-out template functions (clustersim.codegen): when a template gets one."""

from __future__ import annotations

import pytest

from clustersim import codegen


def _write(n: int) -> tuple[list[str], str, list[str]]:
    """A function adding its n cells to x, one line per cell, in order."""
    cells = [f"c{k}" for k in range(n)]
    return cells, "add_all(x)", [f"x = x + c{k}" for k in range(n)] + ["return x"]


def _straight(cells: list) -> codegen.Straight:
    """A template whose structure is its number of cells."""
    return codegen.Straight("t", lambda: ((len(cells),), cells), _write)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(codegen, "_STRUCTURES", {})
    monkeypatch.setattr(codegen, "COMPILE_AFTER", 4)
    monkeypatch.setattr(codegen, "LOOK_AFTER", 2)


def test_templates_run_their_loops_until_their_structure_is_used_enough(fresh):
    a, b = _straight([1.0, 2.0, 4.0]), _straight([10.0, 20.0, 40.0])  # one structure, own values
    other = _straight([1.0, 1.0])  # another structure
    assert a.ready() is None and a.structure is None  # a's 1st use: its structure not read yet
    assert [a.ready(), b.ready()] == [None, None]  # a's 2nd (LOOK_AFTER): read, with both uses
    assert a.structure.uses == 2 and b.structure is None
    assert [other.ready(), other.ready()] == [None, None]
    # b's 2nd use brings its 1st along: the structure's 4th use (COMPILE_AFTER), compiled
    assert b.ready() is b.fn and b.fn(0.0) == 70.0 and a.structure.uses == 4
    assert b.cells is None  # bound into the function, not kept twice
    assert a.ready()(0.5) == 7.5  # the compiled structure, a's own cells
    assert other.ready() is None  # 2 uses of its structure
    assert sum(st.make is not None for st in codegen._STRUCTURES.values()) == 1


def test_a_template_used_a_few_times_never_reads_its_structure(fresh):
    read = []
    t = codegen.Straight("t", lambda: read.append(1) or ((1,), [1.0]), _write)
    assert t.ready() is None and not read and not codegen._STRUCTURES
    t.ready()
    assert read == [1]  # at LOOK_AFTER uses


def test_generated_code_adds_in_the_loops_order():
    """Float sums in the written order (not re-associated): 1e16 + 1 + 1 stays 1e16."""
    make = codegen.compile_maker("order-check", _write(2))
    assert make(1.0, 1.0)(1e16) == (1e16 + 1.0) + 1.0 == 1e16
