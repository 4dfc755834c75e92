"""Fuzzed scenario documents always load or fail with one clear ConfigError (fixed seed,
bounded examples; ``python bench/fuzz_scenarios.py`` runs many more)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, seed, settings

from .conftest import ROOT
from .fuzz_scenarios import check_one, mutations


@seed(20261129)
@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(mutations)
def test_fuzzed_scenarios_load_or_fail_clearly(changes):
    check_one(changes, ROOT)
