"""hetforge: pre-train foundation language models for science on the GPUs a lab actually has."""

__version__ = "0.1.0"
