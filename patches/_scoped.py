"""The context-manager form shared by every patch here."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def scoped(
    apply: Callable[[], bool], undo: Callable[[], None], is_applied: Callable[[], bool]
) -> Iterator[bool]:
    """Apply a patch for the block; yields whether it is in effect. Only the outermost block that
    actually applied it undoes it, so nesting (or entering while it is applied) is safe."""
    applied_here = not is_applied()
    active = apply()
    try:
        yield active
    finally:
        if applied_here and active:
            undo()


@contextlib.contextmanager
def swapped(owner: object, **values) -> Iterator[None]:
    """``owner``'s attributes set to ``values`` for the block, the originals restored after."""
    saved = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)
