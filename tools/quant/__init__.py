"""Measurement tools for quant plugins."""
