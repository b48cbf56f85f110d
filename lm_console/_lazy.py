"""Lazy re-exports for package `__init__` files.

A package re-exports its public names so that users write `from lm_console.engine.config import
EngineArgs`; loading all of them whenever any module of the package is imported would make every
small boundary type pull in the whole subsystem (and, through it, connectors, processors or
torch). So a package lists its names here and each loads on first use. The same imports sit under
`if TYPE_CHECKING:` in the package, for type checkers and for the layering test.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `exports[name]` (a module) on first use."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups find it without this function
        return value

    return __getattr__
