"""Schedule layer: pipeline orders as pure data (see :mod:`.pipeline` for the catalogue)."""

from .pipeline import *  # noqa: F403
from .pipeline import __all__  # noqa: F401
