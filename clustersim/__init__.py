"""clustersim: simulate distributed transformer training on GPU clusters, event by event.

    >>> import clustersim
    >>> result = clustersim.simulate(clustersim.load_scenario("scenarios/gpt3_175b_1024gpu.yaml"))
    >>> result.summary["step_time_s"], result.summary["mfu"]
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .api import Result, simulate
    from .config import Scenario, load_scenario
    from .errors import ConfigError
    from .overrides import load_variant

__version__ = "0.1.0"
__all__ = ["ConfigError", "Result", "Scenario", "load_scenario", "load_variant", "simulate", "__version__"]

# The public names are imported on first use (PEP 562), so that ``python -m clustersim`` can
# set up its process (clustersim/__main__.py) before the simulator and its dependencies load.
_HOME = {"Result": ".api", "simulate": ".api", "Scenario": ".config", "load_scenario": ".config",
         "ConfigError": ".errors", "load_variant": ".overrides"}


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        # a submodule by its dotted name (clustersim.sweep.run_sweep, clustersim.api.Elsewhere), as
        # the docs write them, without importing it first
        try:
            return import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":  # (one it imports is missing: say so)
                raise
        raise AttributeError(f"module 'clustersim' has no attribute {name!r}")
    value = globals()[name] = getattr(import_module(home, __name__), name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
