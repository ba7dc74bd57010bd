"""Accuracy as users measure it: teacher-forced perplexity of a model on a text (perplexity.py)."""
