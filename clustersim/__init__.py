"""clustersim: simulate distributed transformer training on GPU clusters, event by event.

    >>> import clustersim
    >>> result = clustersim.simulate(clustersim.load_scenario("scenarios/gpt3_175b_1024gpu.yaml"))
    >>> result.summary["step_time_s"], result.summary["mfu"]
"""

from .api import Result, simulate
from .config import Scenario, load_scenario
from .errors import ConfigError

__version__ = "0.1.0"
__all__ = ["ConfigError", "Result", "Scenario", "load_scenario", "simulate", "__version__"]
