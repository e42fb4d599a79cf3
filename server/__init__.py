"""OpenAI-compatible HTTP server over the qwen-jax engine: `python -m server --help`."""
