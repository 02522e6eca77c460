"""Integrations with other frameworks (each needs its own extra)."""
