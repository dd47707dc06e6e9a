"""Load user extensions named by import path (``package.module:attribute``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_callable(target: str, what: str) -> Callable[..., Any]:
    """The callable ``target`` names; ValueError naming ``what`` (e.g. "loss 'x'") if it cannot be had."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what}: expected an import path 'package.module:attribute', got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{what}: cannot import module {module_name!r}: {error}") from error
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"{what}: module {module_name!r} has no callable {attr!r}")
    return obj
