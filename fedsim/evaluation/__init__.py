"""Measuring models: ranking metrics and baselines, evaluation set-ups, the centralised ALS reference, JSON records."""
