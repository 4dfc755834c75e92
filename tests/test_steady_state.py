"""bench/steady_state.py: the cycle finder a repeated-microbatch design would rest on, on
made-up intervals and on a real timeline."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from .conftest import ROOT


@pytest.fixture(scope="module")
def steady():
    spec = importlib.util.spec_from_file_location("steady_state", ROOT / "bench" / "steady_state.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_cycle_covering_the_longest_stretch_is_found(steady):
    warm = [0.5, 0.4, 0.3]
    pattern = [0.16, 0.17, 0.15]
    intervals = np.array(warm + pattern * 10 + [0.9, 0.8])
    c, lo, hi = steady.cycle_of(intervals)
    assert (c, lo, hi) == (3, 3, 33)  # the transient and the tail are outside it
    assert steady.cycle_of(np.array([0.1, 0.2, 0.3, 0.4, 0.5])) is None  # nothing repeats
    assert steady.cycle_of(np.full(8, 0.25))[0] == 1  # the smallest cycle, not a multiple


def test_a_one_stage_step_repeats_every_microbatch(steady, capsys):
    """Llama 3 8B on 8 GPUs (DP only, 16 microbatches of gradient accumulation): each
    microbatch starts one microbatch's compute after the last, so every interval is the same."""
    assert steady.main([str(ROOT / "scenarios" / "llama3_8b_8gpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "cycle lengths [1] microbatches" in out
    assert "repeats over 15-15 of its intervals" in out
