"""Built-in kvcompress plugins."""
