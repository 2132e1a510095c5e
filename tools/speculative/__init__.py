"""Measurement tools for speculative plugins."""
