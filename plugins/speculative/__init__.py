"""Built-in speculative plugins."""
