"""Engine: the only package that imports simpy."""

from .sim import Engine, run_program

__all__ = ["Engine", "run_program"]
