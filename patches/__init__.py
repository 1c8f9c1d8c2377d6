"""Runtime patches of code we do not own."""
