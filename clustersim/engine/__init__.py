"""Engine: the only package that imports simpy."""

from . import repeat
from .sim import Engine, run_program

__all__ = ["Engine", "repeat", "run_program"]
