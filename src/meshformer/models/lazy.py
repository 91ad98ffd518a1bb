"""Package attributes imported when first asked (PEP 562 module `__getattr__`), so that importing a package of
models costs no torch: `meshformer config explain` reads the families' config classes (each family's config.py,
torch-free) without building a module, while `from meshformer.models import build_model` still works."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, **modules: tuple[str, ...]):
    """(`__getattr__`, `__dir__`, `__all__`) for `package`: each name in `modules[sub]` is `package.sub`'s attribute
    of that name, imported on first access. Submodules (`from meshformer.models import generate`) import as usual."""
    where = {name: sub for sub, names in modules.items() for name in names}

    def __getattr__(name: str):
        sub = where.get(name)
        if sub is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{sub}"), name)
        setattr(sys.modules[package], name, value)  # asked once: later reads find it as any attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(where) | set(vars(importlib.import_module(package))))

    return __getattr__, __dir__, list(where)
