"""Hugging Face format, both ways."""
