"""megatron_tree: tree training for Megatron-Core."""
