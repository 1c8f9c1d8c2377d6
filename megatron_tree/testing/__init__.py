"""What a user calls to check or exercise tree training, not needed to train: the independent
unpacked reference (``reference``), the justified tolerances (``tolerances``) and synthetic RL
batches with realistic prefix sharing (``synthetic``). Import the submodules.

The suite's harness (tiny models, spawned worlds, the verl / AReaL / TRL engine fixtures and their
CPU platform shims) is not installed: it lives in the repository's ``tests/harness``."""
