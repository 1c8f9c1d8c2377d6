"""Runtime patches of code we do not own (see patches/README.md). Nothing is applied on import."""
