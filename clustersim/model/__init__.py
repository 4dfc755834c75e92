"""Model layer: shapes, FLOPs, bytes and parameters. Knows nothing of hardware or seconds."""

from .transformer import DenseModelCfg, Op, total_params

__all__ = ["DenseModelCfg", "Op", "total_params"]
