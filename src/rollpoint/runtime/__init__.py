"""Runtimes: the only place that knows about processes (embedded) or Ray actors."""
