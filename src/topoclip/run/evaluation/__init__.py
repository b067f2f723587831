"""Evaluation: zero-shot classification and retrieval metrics, computed in chunks."""
