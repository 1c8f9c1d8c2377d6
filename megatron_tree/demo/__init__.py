"""Tooling for the demos and examples, not the library: :mod:`~.quiet` (known upstream warnings
behind one summary line) and :mod:`~.visualize` (a packed tree's attention mask as a picture;
needs matplotlib)."""
