"""The same results on every Python and library version the project allows.

The simulated timeline does not depend on how this Python's ``sum()`` rounds floats: from
3.12 it compensates rounding, and a duration a last bit apart can swap two events due at
the same instant (clustersim.floats). Each scenario below is simulated as it is and with
``sum()`` replaced by the other kind (compensated under 3.10 and 3.11, plain left to right
from 3.12): every span must start and end at the same float, and summary.json be the same
text, bit for bit.

tests/data/oldest-versions.txt pins every dependency at the lower bound pyproject.toml
gives, for a run of the suite with the oldest versions allowed (``pip install -c``)."""

from __future__ import annotations

import builtins
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import clustersim
from clustersim.floats import sum_left


def compensated_sum(xs, start=0):
    """``sum()`` about as Python 3.12 adds floats: Neumaier's compensated sum, here over every
    float met (3.12 compensates exact floats only, adding ints and float subclasses plainly;
    this rounds otherwise more often, which only makes the test stricter)."""
    total, carry = start, 0.0
    for x in xs:
        if isinstance(x, float) or isinstance(total, float):
            t = total + x
            carry += (total - t) + x if abs(total) >= abs(x) else (x - t) + total
            total = t
        else:
            total = total + x
    return total + carry if isinstance(total, float) else total


OTHER_SUM = sum_left if sys.version_info >= (3, 12) else compensated_sum  # (sum_left: 3.11's sum())


def test_the_other_sum_rounds_otherwise():
    """The replacement differs from this Python's sum() on floats, so the test below tests."""
    xs = [1.0, 1e100, 1.0, -1e100]
    assert (OTHER_SUM(xs), sum(xs)) in ((2.0, 0.0), (0.0, 2.0)) and OTHER_SUM(xs) != sum(xs)
    assert sum_left(xs) == 0.0 and sum_left([1, 2]) == 3 and isinstance(sum_left([1, 2]), int)  # (3.11's sum)


def timeline(path) -> tuple:
    """The spans' ranks, tasks, starts and ends as bytes, and summary.json's text."""
    from clustersim.output.summary import to_json

    r = clustersim.simulate(clustersim.load_scenario(path))
    c = r.trace.columns()
    return to_json(r.summary), *(np.asarray(getattr(c, a)).tobytes() for a in ("rank", "tid", "start_s", "end_s"))


@pytest.mark.parametrize("name", ["llama3_8b_8gpu", "grad_accum_llama3_8b_8gpu", "zero3_llama3_8b_16gpu",
                                  "interleaved_1f1b", "custom_schedule"])
def test_the_timeline_is_the_same_whatever_sum_rounds(root, monkeypatch, name):
    path = root / "scenarios" / f"{name}.yaml"
    own = timeline(path)
    monkeypatch.setattr(builtins, "sum", OTHER_SUM)
    assert timeline(path) == own


def test_the_oldest_versions_file_pins_each_lower_bound(root):
    """Every dependency of pyproject.toml (the test extras too) is pinned in
    oldest-versions.txt at its lower bound, and nothing else is."""
    text = (root / "pyproject.toml").read_text()
    bounds = dict(re.findall(r'^\s*"([A-Za-z0-9_-]+)>=([0-9.]+)[;"]', text, re.M))
    bounds.update(re.findall(r'"([A-Za-z0-9_-]+)>=([0-9.]+)"', text[text.index("[project.optional-dependencies]"):]))
    bounds.pop("setuptools", None)
    pins = dict(line.split("==") for line in (root / "tests" / "data" / "oldest-versions.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert set(pins) == set(bounds) and len(bounds) >= 12
    for name, low in bounds.items():
        assert tuple(map(int, pins[name].split("."))) [:len(low.split("."))] == tuple(map(int, low.split("."))), name


def test_memory_terms_add_in_one_order_whatever_the_hash_seed(root):
    """Selective recompute's held bytes add the dropped terms in the terms' own order, not in a
    set's, which the hash seed orders (DeepSeek-V3's came out a last bit apart by seed)."""
    code = ("import sys, clustersim\n"
            "from clustersim.model.transformer import RECOMPUTE_MODULES, recomputed_bytes\n"
            "m = clustersim.load_scenario('scenarios/deepseek_v3_2048gpu.yaml').model\n"
            "print([recomputed_bytes(m, 1, t, True, False, moe, modules=tuple(RECOMPUTE_MODULES)).hex()\n"
            "       for t in (1, 3, 7, 4096) for moe in (False, True)])\n")
    outs = {subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
            for seed in range(8)}
    assert len(outs) == 1, outs
