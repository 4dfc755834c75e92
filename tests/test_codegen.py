"""Written-out template functions (clustersim.codegen): when a template gets one."""

from __future__ import annotations

import pytest

from clustersim import codegen


def _write(n: int) -> tuple[list[str], str, list[str]]:
    """A function adding its n cells to x, one line per cell, in order."""
    cells = [f"c{k}" for k in range(n)]
    return cells, "add_all(x)", [f"x = x + c{k}" for k in range(n)] + ["return x"]


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(codegen, "_STRUCTURES", {})
    monkeypatch.setattr(codegen, "COMPILE_AFTER", 4)


def test_templates_run_their_loops_until_their_structure_is_used_enough(fresh):
    a = codegen.Straight("t", (3,), _write, [1.0, 2.0, 4.0])
    b = codegen.Straight("t", (3,), _write, [10.0, 20.0, 40.0])  # same structure, its own values
    other = codegen.Straight("t", (2,), _write, [1.0, 1.0])  # another structure
    assert [a.ready(), b.ready(), a.ready()] == [None, None, None]  # 3 uses of the structure
    assert other.ready() is None
    assert a.ready() is a.fn and a.fn(0.5) == 7.5  # its 4th use (COMPILE_AFTER): compiled
    assert a.cells is None  # bound into the function, not kept twice
    assert b.ready()(0.0) == 70.0  # the compiled structure, b's own cells
    assert other.ready() is None  # 2 uses of its structure
    assert sum(st.make is not None for st in codegen._STRUCTURES.values()) == 1


def test_generated_code_adds_in_the_loops_order():
    """Float sums in the written order (not re-associated): 1e16 + 1 + 1 stays 1e16."""
    make = codegen.compile_maker("order-check", _write(2))
    assert make(1.0, 1.0)(1e16) == (1e16 + 1.0) + 1.0 == 1e16
