"""The demo model: synthetic verifiable tasks, training, evaluation."""
