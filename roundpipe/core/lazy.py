"""`lazy_module`: a package's public names, each imported from its module only when first read (PEP 562).

    _LAZY = {"wrap": "roundpipe.hf.model", ...}
    __all__ = list(_LAZY)
    __getattr__, __dir__ = lazy_module(__name__, _LAZY, globals())

Why: roundpipe.hf and roundpipe.diffusers sit over transformers and diffusers, which take seconds to import
and may be missing; `import roundpipe` must import neither (tests/hf/test_hf.py, tests/diffusers/test_wrap.py).
A name read once is stored in the package's globals, so later reads skip `__getattr__`.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_module(package: str, table: dict[str, str],
                namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`, whose globals are `namespace`: `table` maps each
    lazy name to the module that defines it; any other name is an AttributeError, as for a plain module."""

    def __getattr__(name: str) -> Any:
        module_name = table.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
