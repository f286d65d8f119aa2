"""Lazy re-exports for a layer's ``__init__``: its public names, imported on first use.

Each layer folder re-exports its public names from ``__init__`` (trio's habit), so a
reader finds a layer's surface in one file. Importing them eagerly would make every
``qosfs ctl`` call pay for the whole daemon (the control layer's face alone costs 130 ms
of imports: trio, prometheus_client), so a face names its exports and this module imports
the defining module when a name is first read (PEP 562). Type checkers read the face's
``if TYPE_CHECKING:`` imports instead; tests/architecture checks that the two agree.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["lazy_face"]


def lazy_face(package: str, exports: Mapping[str, tuple[str, ...]]
              ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for *package*, exporting ``exports[module]`` names
    from each of its modules."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # the next read is a plain lookup
        return value

    def __dir__() -> list[str]:
        return sorted(set(where) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
