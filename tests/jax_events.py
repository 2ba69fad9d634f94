"""Counting what JAX did inside a block, for tests that assert something was not compiled."""

import contextlib
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
    """Counts XLA compilations inside the block (JAX's monitoring events)."""
    events: list[str] = []

    def listener(name, *args, **kwargs):
        if "compile" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
