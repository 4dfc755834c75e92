"""Fuzzed scenario and topology documents always load or fail with one clear ConfigError
(fixed seed, bounded examples; ``python bench/fuzz_scenarios.py`` and
``python bench/fuzz_topologies.py`` run many more)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, seed, settings

from .conftest import ROOT
from .fuzz_scenarios import check_one, mutations
from .fuzz_topologies import check_one as check_topology
from .fuzz_topologies import examples as topology_examples


@seed(20261129)
@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(mutations)
def test_fuzzed_scenarios_load_or_fail_clearly(changes):
    check_one(changes, ROOT)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    """Where each example writes its topology and scenario (overwritten by the next)."""
    return tmp_path_factory.mktemp("fuzz-topologies")


@seed(20261130)
@settings(max_examples=250, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ex=topology_examples())
def test_fuzzed_topologies_load_or_fail_clearly(fuzz_dir, ex):
    """A mutated topology named by a scenario loads (and its cluster builds) or fails with one
    ConfigError naming the topology file and the field, each in under BOUND_S seconds
    (``python bench/fuzz_topologies.py`` runs 10,000)."""
    check_topology(ex, fuzz_dir)
