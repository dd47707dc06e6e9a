"""Triton kernels for the torch engine on CUDA (placeholder: filled in next)."""


def install(runner) -> None:
    return None
