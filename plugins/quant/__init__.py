"""Built-in quant plugins."""
