"""The test harness: what the suite, the examples and the benchmarks need to run the library on a
CPU, kept out of the installed package (setup.py packages ``megatron_tree`` only;
tests/test_layout.py holds that).

Tiny HF checkpoints and Megatron models (``models``), spawned gloo worlds (``dist``), the engine
fixtures of verl, AReaL and TRL (``verl``, ``verl_fsdp``, ``areal``, ``areal_fsdp``, ``trl``) and
the CPU platform shims that monkeypatch verl and AReaL so their engines run without a GPU
(``verl_platform``, ``areal_platform``), pytest marks and Hypothesis strategies. What a user calls
(the unpacked reference, the tolerances, the synthetic batches) stays in ``megatron_tree.testing``.

Importable as ``harness`` with ``tests/`` on ``sys.path``: pytest puts it there (``tests/`` has no
``__init__.py``, so its conftest's folder is prepended); a script or example inserts
``<repository>/tests`` before its first harness import, and spawned workers inherit the path.
"""
