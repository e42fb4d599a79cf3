"""Pallas GPU kernels for qwen-jax, each beside a plain-jnp `reference()` with the same signature."""
