"""Built-in plugins, one folder per plugin under its kind. Plugins never import vLLM."""
