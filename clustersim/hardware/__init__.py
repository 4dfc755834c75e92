"""Hardware layer: GPU catalogue and cluster topology graph. Knows nothing of models."""

from .gpus import GPUS, GpuSpec, lookup_gpu
from .topology import Cluster, TopologyCfg, build_cluster, load_topology_cfg

__all__ = ["GPUS", "GpuSpec", "lookup_gpu", "Cluster", "TopologyCfg", "build_cluster", "load_topology_cfg"]
