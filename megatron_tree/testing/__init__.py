"""What exists for tests, demos and benchmarks, not for training: synthetic batches, small models,
the independent unpacked reference, and the spawned-world harness. Import the submodules."""
