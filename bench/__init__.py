"""Durable Check's benchmark suite: performance judged against this stack's limits, measured side by side."""
