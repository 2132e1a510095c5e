"""Measurement tools for moe plugins."""
