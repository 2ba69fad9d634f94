"""Errors raised inside host callbacks, raised again as themselves in the caller.

JAX re-raises an exception from inside a callback (``pure_callback``, ``io_callback``,
``rollout._host_call.host_call``) as a ``jax.errors.JaxRuntimeError`` (a ``ValueError`` on some
dispatch paths) that carries only its text, and, since the program had an effect, keeps that
error in the device's runtime token, which raises it again at every ``jax.effects_barrier()``
and at interpreter exit. The callbacks of this package record their own errors here
(``remember``: an ``on_cpu`` worker's ``WorkerError``, a host env's ``HostEnvError``), and
``worker_errors()`` raises the original again, chained to JAX's, once.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

_recent: collections.deque[Exception] = collections.deque(maxlen=16)
_lock = threading.Lock()


def remember(error: Exception) -> None:
    """Records a copy of an error a callback is about to raise (for ``worker_errors``): its
    type, message and attributes. Not the error itself: as it is raised, it takes on the
    callback's frames, which hold the call's arguments; kept here, they stayed alive."""
    with _lock:
        _recent.append(copy.copy(error))  # (no traceback, no chained errors)


def _recall(text: str) -> Exception | None:
    """The latest recorded error whose message appears in ``text`` (then forgotten; another
    thread's failure of the same text finds its own. The records left by the other devices
    of a failed program are copies no caller raised: they hold no frames)."""
    with _lock:
        for error in reversed(_recent):
            if str(error) in text:
                _recent.remove(error)
                return error
    return None


def finish_dispatched() -> None:
    """Waits for the programs already dispatched to make their callbacks (JAX runs them
    asynchronously), before their workers are closed: a callback after ``close`` would restart
    them. A failed program's error is not raised again here: its caller got it already."""
    import jax

    try:
        jax.effects_barrier()
    except Exception:
        pass


def wait_for_outputs(outputs: Any, after_failure: float = 5.0) -> tuple[bool, Exception | None]:
    """Waits until every device's part of the call that made ``outputs`` has ended: all of it
    while no part has failed; once one has (an ``on_cpu`` worker killed under its rows), up to
    ``after_failure`` s more, since a device left waiting in a collective for the failed one
    never ends its part (reading the outputs in order waited on such a part until XLA aborted
    the process, before reaching the failed one). Returns (every part ended, the first part's
    error or None); nothing is raised. Deleted (donated) arrays are passed over."""
    pending = [part for x in _live(outputs) for part in _parts(x)]
    deadline, error = None, None
    while pending:
        waiting = []
        for part in pending:
            try:
                if part.is_deleted():
                    continue
                if not part.is_ready():
                    waiting.append(part)
                elif error is None:
                    part.block_until_ready()  # ended: raises here if it failed
            except Exception as e:  # a failed part
                error = error or e
                deadline = deadline or time.monotonic() + after_failure
        pending = waiting
        if pending and deadline is not None and time.monotonic() > deadline:
            return False, error
        if pending:
            time.sleep(0.002)
    return True, error


def _live(tree: Any) -> list[Any]:
    import jax

    return [x for x in jax.tree.leaves(tree) if not (hasattr(x, "is_deleted") and x.is_deleted())]


def _parts(x: Any) -> list[Any]:
    try:
        return [shard.data for shard in getattr(x, "addressable_shards", ())]
    except Exception:  # deleted meanwhile
        return []


def _drop_failed_tokens() -> None:
    """Forgets the runtime tokens that hold the error just raised, so that it is not raised
    again by every later ``jax.effects_barrier()`` and at exit. JAX has no public way to do
    this; where its private token set has moved, nothing is dropped (only the exit is noisier).
    """
    try:
        from jax._src import dispatch

        tokens = dispatch.runtime_tokens.output_runtime_tokens
    except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX release
        return
    for device, token in list(tokens.items()):
        try:
            token.block_until_ready()
        except Exception:
            tokens.pop(device, None)


@contextlib.contextmanager
def worker_errors() -> Iterator[None]:
    """Raise worker failures inside ``with`` as themselves, also from jitted code.

    An ``on_cpu`` function called eagerly raises :class:`rollout.WorkerError` (or
    :class:`rollout.WorkerTimeout`) itself. Called inside ``jax.jit`` / ``shard_map``, it fails
    inside a JAX callback, and JAX re-raises that as a ``jax.errors.JaxRuntimeError`` (a
    ``ValueError`` on some dispatch paths) carrying only the text; the same holds for a host
    env's ``HostEnvError`` (an env that raised, a worker that died). This context manager (also
    usable as a decorator) turns such an error back into the original exception, chained to
    JAX's (``__cause__``); other errors pass unchanged. ``rollout.ppo.train`` uses it.

    Example (a worker timing out inside a jitted call):
      >>> import jax, jax.numpy as jnp, rollout
      >>> def forever(x):
      ...     return jax.lax.while_loop(lambda v: v[0] > -1.0, lambda v: v + 1.0, x)
      >>> f = rollout.on_cpu(forever, workers=1, timeout=0.2)
      >>> try:  # the with turns JAX's error back into the worker's as it exits: catch outside
      ...     with rollout.worker_errors():  # blocking keeps the error inside the with
      ...         jax.block_until_ready(jax.jit(f)(jnp.zeros(2)))
      ... except rollout.WorkerError as e:  # itself, not JAX's wrapper
      ...     print(type(e).__name__)
      WorkerTimeout
      >>> f.close()
    """
    try:
        yield
    except Exception as e:  # JaxRuntimeError, or ValueError from some dispatch paths
        original = _recall(str(e))
        if original is None or original is e:
            raise
        _drop_failed_tokens()
        raise original from e
