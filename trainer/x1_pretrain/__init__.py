"""X1 trainer: data, model, the training loop, and the run's artifacts."""
