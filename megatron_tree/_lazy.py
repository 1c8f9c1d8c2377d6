"""Classes that subclass Megatron types, built on first access so importing us imports no Megatron."""

from __future__ import annotations

from typing import Callable


def lazy_class_getattr(module_name: str, factories: dict[str, Callable[[], type]]):
    """A module ``__getattr__`` that builds each named class once, from its factory, on first use."""
    cache: dict[str, type] = {}

    def __getattr__(name: str) -> type:
        if name not in factories:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        if name not in cache:
            cls = factories[name]()
            cls.__module__, cls.__qualname__ = module_name, name
            cache[name] = cls
        return cache[name]

    return __getattr__
