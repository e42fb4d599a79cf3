"""qwen-jax: a JAX/Pallas inference engine for Qwen3.5 hybrid (Gated DeltaNet + gated attention) models."""

__version__ = "0.1.0"
