"""Watching a run: the dashboard, its JSON snapshot, Prometheus metrics and ``dipaco status``."""
