"""Warnings attributed to the user's line.

A fixed ``stacklevel`` counts frames, and the count changes whenever a call goes through one
more helper, a cache or a JAX trace: the warning then names a line inside this library, and a
``warnings`` filter by module or line no longer matches the user's code. ``warn_user`` walks
the stack instead, out of this library and the libraries it calls through.
"""

from __future__ import annotations

import sys
import warnings

# Packages whose frames lie between the user's call and a warning raised in this library
# (jit traces, Flax's module machinery, optax's tree maps, context managers, threads, -m).
_THROUGH = frozenset(
    {
        *("ensemble", "rollout", "jax", "jaxlib", "flax", "optax", "chex", "orbax"),
        *("contextlib", "functools", "threading", "concurrent", "importlib", "runpy"),
    }
)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the innermost frame outside the
    packages above; to the line that called this where there is none (a callback thread)."""
    frame, level = sys._getframe(1), 2  # level 2: warn_user's caller
    while frame is not None:
        spec = frame.f_globals.get("__spec__")  # names a `python -m` __main__ by its package
        module = spec.name if spec is not None else frame.f_globals.get("__name__", "")
        if module.partition(".")[0] not in _THROUGH:
            break
        frame, level = frame.f_back, level + 1
    else:
        level = 2
    warnings.warn(message, category, stacklevel=level)
