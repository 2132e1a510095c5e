"""Built-in attention plugins."""
