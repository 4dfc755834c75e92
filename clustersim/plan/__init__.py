"""Plan layer: the rank mesh, groups and layer placement."""

from .mesh import Mesh, split_layers

__all__ = ["Mesh", "split_layers"]
