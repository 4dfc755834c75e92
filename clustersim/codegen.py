"""Straight-line Python for the templates a step repeats thousands of times.

A pipeline rank runs the same action (a stage's forward, its backward) for every microbatch:
the lowering makes its tasks, and the engine times them, from one template each time. A loop
that reads a template's tuples task by task spends most of its time on the reading; a
function written out for the template, with its constants as closure cells and its slots as
local variables, does only the work::

    template (durations D, forms F)      generated once per structure, compiled once:
    task 0: after input 1                    def make(D0, F0, D1, F1):
    task 1: after task 0 and input 2             def timed(...):
                                                     s = v1; e0 = s + D0; ...
                                                     s = e0
                                                     if v2 > s: s = v2
                                                     e1 = s + D1; ...
                                                 return timed

Templates with the same structure (which slot each task reads, which fields it has) share one
compiled maker: a step has a few structures and hundreds of templates (Megatron-1T: 128
templates, 6 structures in the lowering). Compiling costs 150-400 us per task of the
structure, and the written-out function saves about 0.7 us per task and use, so compiling pays
for itself after 200-400 uses: the templates of a structure run their loops until the structure
has been used COMPILE_AFTER times, then compile it. As in renting skis until their price is
paid, then buying them, a structure never costs much more than twice what the better choice in
hindsight would have; a step of hundreds of microbatches gains most of the saving, and one of
a few dozen (moe_1024gpu: its structures are used 16-151 times) never compiles. A template's
own structure is read only after LOOK_AFTER uses of it (moe_1024gpu's are used about 9 times
each). Generated code runs the same operations in the same order as the loop it replaces, so
its results are the same to the bit.
"""

from __future__ import annotations

from collections.abc import Callable

# (kind, structure) -> its record (_Structure); a step needs a few dozen, the bound only guards
# a long-lived process that simulates many different programs
_STRUCTURES: dict[tuple, _Structure] = {}
MAX_STRUCTURES = 10_000
COMPILE_AFTER = 256  # uses of a structure before it is compiled (see above)
LOOK_AFTER = 16  # uses of a template before its structure is read (Straight)


class _Structure:
    """One structure: how many times its templates were used, and its maker once compiled."""

    __slots__ = ("uses", "make")

    def __init__(self):
        self.uses = 0
        self.make: Callable | None = None


class Straight:
    """One template's written-out function, once its structure is worth compiling:
    :meth:`ready` counts a use and gives the function, or None while the template should run
    its loop. ``prepare()`` gives (the template's structure, its values as cells), read only
    once the template itself has been used LOOK_AFTER times (a template used a few times never
    pays for reading it); ``write(*structure)`` gives the source (see :func:`compile_maker`),
    ``scope`` the globals the source may name."""

    __slots__ = ("kind", "prepare", "write", "scope", "uses", "shape", "cells", "structure", "fn")

    def __init__(self, kind: str, prepare: Callable[[], tuple[tuple, list]], write: Callable,
                 scope: dict | None = None):
        self.kind, self.prepare, self.write, self.scope = kind, prepare, write, scope
        self.uses = 0
        self.shape: tuple | None = None
        self.cells: list | None = None
        self.structure: _Structure | None = None
        self.fn: Callable | None = None

    def ready(self) -> Callable | None:
        if self.fn is not None:
            return self.fn
        structure = self.structure
        if structure is None:
            self.uses += 1
            if self.uses < LOOK_AFTER:
                return None
            self.shape, self.cells = self.prepare()
            self.prepare = None
            key = (self.kind, self.shape)
            structure = _STRUCTURES.get(key)
            if structure is None:
                if len(_STRUCTURES) >= MAX_STRUCTURES:
                    _STRUCTURES.clear()
                structure = _STRUCTURES[key] = _Structure()
            self.structure = structure
            structure.uses += self.uses - 1  # its uses so far count for the structure too
        structure.uses += 1
        if structure.make is None and structure.uses >= COMPILE_AFTER:
            structure.make = compile_maker(self.kind, self.write(*self.shape), self.scope)
        if structure.make is not None:
            self.fn = structure.make(*self.cells)
            self.cells = self.shape = None
        return self.fn


def compile_maker(kind: str, source: tuple[list[str], str, list[str]], scope: dict | None = None) -> Callable:
    """``make(*cells)``, which returns the function ``source`` describes (the cells' names,
    the function's signature, its body's lines) with the cells bound; ``scope``: the globals
    it may name."""
    cells, signature, body = source
    src = (f"def make({', '.join(cells)}):\n    def {signature}:\n"
           + "".join(f"        {line}\n" for line in body) + f"    return {signature.split('(')[0]}\n")
    space = dict(scope or {})
    exec(compile(src, f"<{kind}>", "exec"), space)  # noqa: S102 - source written from ints, not input
    return space["make"]
