"""The one hook both bridge patches put on a bridge class's ``__init__``.

:class:`InitHook` wraps the class's ``__init__`` while at least one enabled block is open and
restores it when the outermost enabled block closes. Blocks nest: a bridge created at some point
gets what the innermost open block says (its settings, or nothing for ``enable=False``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any


class InitHook:
    """Binds tree training to bridges created inside enabled blocks.

    Args:
        bind: ``bind(bridge, **settings)`` after the class's own ``__init__``.
        before: ``before(bridge)`` ahead of it (fixes that must precede the config it builds).
    """

    def __init__(self, bind: Callable[..., None], before: Callable[[Any], None] | None = None):
        self._bind, self._before = bind, before
        self._blocks: list[dict | None] = []  # the open blocks' settings, innermost last
        self._original: Callable | None = None  # the class's own __init__ while wrapped

    @contextlib.contextmanager
    def block(self, owner: type, settings: dict | None) -> Iterator[None]:
        """A block whose bridges of class ``owner`` get ``settings`` (None: plain bridges)."""
        install = settings is not None and self._original is None
        if install:
            original = self._original = owner.__init__

            @functools.wraps(original)
            def init(bridge, *args, **kwargs):
                current = self._blocks[-1] if self._blocks else None
                if current is not None and self._before is not None:
                    self._before(bridge)
                original(bridge, *args, **kwargs)
                if current is not None:
                    self._bind(bridge, **current)

            owner.__init__ = init
        self._blocks.append(settings)
        try:
            yield
        finally:
            self._blocks.pop()
            if install:
                owner.__init__, self._original = self._original, None


def cpu_patch_applied() -> bool:
    """Whether :mod:`megatron_tree.patches.megatron_cpu` is in effect, without importing it (the
    bridges never pull the CPU patch in: it is applied only where a caller imported it)."""
    patch = sys.modules.get("megatron_tree.patches.megatron_cpu")
    return patch is not None and patch.is_applied()
