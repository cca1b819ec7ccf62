"""strata: a PyTorch inference engine for Qwen3-Next models with grouped MTP speculative decoding."""

__version__ = "0.1.0"
