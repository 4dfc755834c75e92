"""Program layer: lowering a scenario into per-rank tasks (pure functions)."""

from .tasks import Comm, Program, Task

__all__ = ["Comm", "Program", "Task"]
