"""Measurement tools for attention plugins."""
