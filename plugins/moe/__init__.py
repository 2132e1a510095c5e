"""Built-in moe plugins."""
