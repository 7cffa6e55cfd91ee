"""Running a trained model: per-token log-probabilities of given sequences (score.py)."""
