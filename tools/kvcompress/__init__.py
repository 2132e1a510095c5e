"""Measurement tools for kvcompress plugins."""
