"""Names a package imports on first use (its module `__getattr__`): `import batchrun` and the commands that need
no model stay light, without torch."""

from __future__ import annotations


def lazy_exports(package: str, exports: dict[str, str]):
    """A module `__getattr__` that imports `exports[name]` (relative to `package`) on first use of `name`."""

    def __getattr__(name: str):
        if name in exports:
            import importlib

            return getattr(importlib.import_module(exports[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
