"""Loads the compiled engine (libcausal_attention.so), which registers torch.ops.causal_attention.*.

The engine missing (a source checkout that was never built, a platform without a build) is not an
error: the module falls back to the ``sdpa`` backend and warns once (see ``backends.py``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_LIBRARY_NAME = "libcausal_attention.so"


@functools.cache
def load_error() -> str | None:
    """Loads the compiled core once; returns why it could not be loaded, or None when it is loaded."""
    path = Path(__file__).with_name(_LIBRARY_NAME)
    if not path.exists():
        return f"{path} does not exist (build the package: make install)"
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:  # a broken or mismatched build
        return f"loading {path} failed: {exc}"
    return None


def core_loaded() -> bool:
    """True when the compiled C++ engine is loaded and its ops are registered."""
    return load_error() is None
