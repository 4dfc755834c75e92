"""Schedule layer: pipeline orders as pure data."""

from .pipeline import SCHEDULES, Action, Schedule, build_schedule, format_grid, parse_grid, unit_time_grid

__all__ = ["SCHEDULES", "Action", "Schedule", "build_schedule", "format_grid", "parse_grid", "unit_time_grid"]
