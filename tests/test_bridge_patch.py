"""The one bridge-patch hook (``megatron_tree.bridges._hook.InitHook``) both bridge patches use:
nesting, ``enable=False`` inside an enabled block, restoration on exit and on error; and that
importing the Megatron-Bridge module patches nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_tree.bridges._hook import InitHook


class _Bridge:
    settings, before = None, False  # set on the instance by bind / before

    def __init__(self, name):
        self.name = name


def _hook():
    def bind(bridge, **settings):
        bridge.settings = settings

    def before(bridge):
        bridge.before = True

    return InitHook(bind=bind, before=before)


def test_blocks_nest_and_the_innermost_decides():
    hook, own_init = _hook(), _Bridge.__init__
    assert _Bridge("plain").settings is None
    with hook.block(_Bridge, {"backend": "sdpa"}):
        outer = _Bridge("a")
        with hook.block(_Bridge, {"backend": "flex"}):
            inner = _Bridge("b")
        with hook.block(_Bridge, None):  # enable=False inside an enabled block: plain bridges
            disabled = _Bridge("c")
        after = _Bridge("d")
    assert (outer.settings, inner.settings, disabled.settings, after.settings) == (
        {"backend": "sdpa"},
        {"backend": "flex"},
        None,
        {"backend": "sdpa"},
    )
    assert outer.before and not disabled.before and outer.name == "a"
    assert _Bridge.__init__ is own_init and _Bridge("plain").settings is None


def test_enabled_inside_disabled_and_restored_on_error():
    hook, own_init = _hook(), _Bridge.__init__
    with hook.block(_Bridge, None):
        assert _Bridge.__init__ is own_init  # nothing installed by a disabled block
        with hook.block(_Bridge, {"backend": "sdpa"}):
            assert _Bridge("x").settings == {"backend": "sdpa"}
        assert _Bridge.__init__ is own_init and _Bridge("y").settings is None
    with pytest.raises(RuntimeError, match="inside"), hook.block(_Bridge, {"backend": "sdpa"}):
        raise RuntimeError("inside")
    assert _Bridge.__init__ is own_init


def test_both_patches_are_exported_at_the_package_root():
    import megatron_tree
    from megatron_tree.bridges import mbridge, megatron_bridge

    assert megatron_tree.patch_bridge_for_tree_training is mbridge.patch_bridge_for_tree_training
    assert (
        megatron_tree.patch_megatron_bridge_for_tree_training
        is megatron_bridge.patch_megatron_bridge_for_tree_training
    )


def test_importing_the_megatron_bridge_patch_patches_nothing():
    code = (
        "import sys, megatron_tree.bridges.megatron_bridge\nprint(sorted(m for m in sys.modules if "
        "m.startswith('megatron.bridge')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
