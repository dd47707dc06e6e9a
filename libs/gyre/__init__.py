"""Gyre: asynchronous RL for language models (shared, torch-free library)."""

__version__ = "0.1.0"
