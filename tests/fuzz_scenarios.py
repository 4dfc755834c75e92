"""Property-based fuzzing of scenario documents (shared by the CI test and the long run).

A valid small scenario is mutated at 1-3 places (a known field or an unknown key) with values
of every awkward kind: wrong types, zero, negative, NaN, infinities, huge numbers, strings,
lists, mappings, null, or the key removed. Loading must end in a Scenario or in one
ConfigError naming the file and the field: never another exception.
"""

from __future__ import annotations

import copy
import math

from hypothesis import strategies as st

from clustersim.config import ScenarioCfg
from clustersim.errors import ConfigError

from .conftest import SMALL
from .test_docs import field_paths

PATHS = sorted(p for p in field_paths(ScenarioCfg) if "[]" not in p) + ["training.no_such_key", "nonsense"]
DELETE = object()

values = st.one_of(
    st.integers(min_value=-(10**15), max_value=10**15),
    st.sampled_from([0, -1, 1, 2, 3, 7, 10**9, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
    st.lists(st.integers(min_value=-5, max_value=100), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.just(DELETE),
)
mutations = st.lists(st.tuples(st.sampled_from(PATHS), values), min_size=1, max_size=3)


def mutate(doc: dict, changes) -> dict:
    d = copy.deepcopy(doc)
    for path, value in changes:
        keys = path.split(".")
        cur = d
        for k in keys[:-1]:
            nxt = cur.get(k) if isinstance(cur, dict) else None
            if not isinstance(nxt, dict):
                nxt = {}
                if isinstance(cur, dict):
                    cur[k] = nxt
            cur = nxt
        if value is DELETE:
            cur.pop(keys[-1], None)
        else:
            cur[keys[-1]] = value
    return d


def check_one(changes, root) -> None:
    """Load the mutated scenario: a Scenario, or a ConfigError with a file and a field."""
    import clustersim

    doc = mutate(SMALL, changes)
    try:
        sc = clustersim.load_scenario(doc, base_dir=root)
    except ConfigError as exc:
        assert exc.source, exc
        assert "\n" not in exc.line()
        return
    # it loaded: the derived figures every later stage reads must be sane
    assert sc.mesh.world_size >= 1 and sc.microbatches >= 1
    assert all(n >= 1 for n in sc.layers_per_part)
    assert math.isfinite(sc.tokens_per_step)
