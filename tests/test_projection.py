"""Run projections: days, GPU-hours, cost and energy for a token budget, from the step."""

from __future__ import annotations

import pytest

import clustersim
from clustersim.errors import ConfigError

from .conftest import scenario_dict


def test_projection_follows_from_tokens_per_second(root):
    d = scenario_dict(training={"global_batch_size": 16},
                      projection={"tokens": 2e12, "usd_per_gpu_hour": 2.5, "pue": 1.2})
    s = clustersim.simulate(clustersim.load_scenario(d, base_dir=root)).summary
    pj, world = s["projection"], s["world_size"]
    seconds = 2e12 / s["tokens_per_s"]
    assert pj["days"] == pytest.approx(seconds / 86400, rel=1e-12)
    assert pj["gpu_hours"] == pytest.approx(world * seconds / 3600, rel=1e-12)
    assert pj["cost_usd"] == pytest.approx(2.5 * pj["gpu_hours"], rel=1e-12)
    assert pj["energy_MWh"] == pytest.approx(pj["gpu_hours"] * 400 * 1.2 / 1e6, rel=1e-12)  # A100: 400 W
    assert pj["steps"] == pytest.approx(2e12 / (16 * 512), rel=1e-12)
    # the step time sets it all: twice the steps' time, twice the days
    assert pj["days"] == pytest.approx(pj["steps"] * s["step_time_s"] / 86400, rel=1e-9)


def test_no_price_no_cost(root):
    s = clustersim.simulate(clustersim.load_scenario(scenario_dict(), base_dir=root)).summary
    assert s["projection"]["cost_usd"] is None and s["projection"]["tokens"] == 1e12


@pytest.mark.parametrize("projection, field", [
    ({"tokens": 0}, "projection.tokens"),
    ({"pue": 0.9}, "projection.pue"),
    ({"usd_per_gpu_hour": -1}, "projection.usd_per_gpu_hour"),
])
def test_bad_projection_names_the_field(root, projection, field):
    with pytest.raises(ConfigError, match=field):
        clustersim.load_scenario(scenario_dict(projection=projection), base_dir=root)
