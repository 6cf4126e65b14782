"""`mooncake.store`, served by `tycho.store` (see the package docstring)."""

from tycho.store import *  # noqa: F401,F403
from tycho.store import __all__  # noqa: F401
