"""Training state on disk: checkpoints and the streaming tensor file."""
