"""Gyre inference service: OpenAI-compatible HTTP API, torch/vLLM backends, gRPC weight control."""
