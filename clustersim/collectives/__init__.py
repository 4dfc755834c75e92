"""Collective algorithms: expansion into point-to-point flows, and their closed forms."""

from .ring import Expansion, expand, ring_allreduce_time_s

__all__ = ["Expansion", "expand", "ring_allreduce_time_s"]
