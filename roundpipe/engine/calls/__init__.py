"""One call of the wrapper: microbatches, round-robin dispatch, stage runs on workers, hand-offs."""
