"""Adapters that switch tree training on inside RL frameworks (imported only on demand)."""
