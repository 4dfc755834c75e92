"""Collective algorithms: expansion into point-to-point flows, and their closed forms."""

from .ring import Expansion, all_to_all_sources, expand, ring_allreduce_time_s

__all__ = ["Expansion", "all_to_all_sources", "expand", "ring_allreduce_time_s"]
