"""Many train steps in one compiled call, for the linen and the NNX train step alike.

A step whose work is small (a few MLP layers on a batch of 64) costs less than dispatching it:
one jitted call per batch then runs at the speed of the Python loop that makes the calls, and a
mesh of several devices costs more to dispatch than one device. ``step.scan(...)`` takes the
batches of K steps stacked on a leading axis and runs the K steps as one ``lax.scan`` inside one
program, so the dispatch is paid once per K steps. Batch arguments that are the same at every
step (a dataset the steps index into) are marked ``stacked=False`` and passed once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_CLOSE_OVER = (
    "the train step traces its batch arguments, as jax.jit does, so a Python flag or mode "
    "passed as one is not a Python value in the loss; give it to the loss by closing over it "
    "(functools.partial(loss_fn, train=False)) and pass arrays as batch arguments"
)


@contextlib.contextmanager
def traced_batch(batch: Sequence[Any]) -> Iterator[None]:
    """Says why, where a batch argument holds a Python value the loss cannot trace: a string
    (JAX: "Error interpreting argument ... as an abstract array"), or a bool the loss branches
    on with ``if`` (JAX: a TracerBoolConversionError naming the step's internals)."""
    for pos, arg in enumerate(batch):
        for path, leaf in jax.tree_util.tree_leaves_with_path(arg):
            if isinstance(leaf, str | bytes):
                where = f"batch argument {pos}{jax.tree_util.keystr(path)} = {leaf!r}"
                raise TypeError(f"{where} is a string: {_CLOSE_OVER}.")
    try:
        yield
    except jax.errors.TracerBoolConversionError as e:
        if not any(isinstance(leaf, bool) for leaf in jax.tree.leaves(tuple(batch))):
            raise
        first = (str(e).splitlines() or [""])[0]
        raise TypeError(
            f"a traced value was used in Python control flow ({first}); a Python bool is among "
            f"the batch arguments: if the loss branches on it, {_CLOSE_OVER}."
        ) from e


def stacked_flags(stacked: bool | Sequence[bool], count: int) -> tuple[bool, ...]:
    """One flag per batch argument: stacked per step (True) or the same at every step."""
    if isinstance(stacked, bool | np.bool_):
        return (bool(stacked),) * count
    flags = tuple(bool(s) for s in stacked)
    if len(flags) != count:
        raise ValueError(
            f"stacked={tuple(stacked)} gives one flag per batch argument, but {count} batch "
            "argument(s) were passed."
        )
    return flags


def one_step_of(batches: Sequence[Any], stacked: tuple[bool, ...]) -> tuple[Any, ...]:
    """One step's batch arguments: the stacked ones as per-step shape structs, the others as
    they are (for the checks a single step makes on its inputs).

    Every leaf of the stacked arguments must have the same leading length K >= 1; anything
    else is one clear error.
    """
    leaves = [
        (pos, path, leaf)
        for pos, (arg, flag) in enumerate(zip(batches, stacked))
        if flag
        for path, leaf in jax.tree_util.tree_leaves_with_path(arg)
    ]
    if not leaves:
        raise ValueError(
            "scan needs at least one batch argument stacked on a leading steps axis; for "
            "batches that are the same at every step, call the step itself."
        )
    steps = None
    for pos, path, leaf in leaves:
        shape = np.shape(leaf)
        if steps is None and shape:
            steps = shape[0]
        if not shape or shape[0] != steps or shape[0] == 0:
            raise ValueError(
                f"batch argument {pos}{jax.tree_util.keystr(path)} has shape {shape}; scan takes "
                f"every stacked batch argument with a leading steps axis of the same length "
                f"({steps} from the first), at least 1. Mark an argument that is the same at "
                "every step with stacked=False."
            )
    row = lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x))
    return tuple(jax.tree.map(row, arg) if flag else arg for arg, flag in zip(batches, stacked))


def scan_steps(
    one: Callable[[Any, tuple[Any, ...]], tuple[Any, Any]],
    carry: Any,
    batches: Sequence[Any],
    stacked: tuple[bool, ...],
) -> tuple[Any, Any]:
    """``one(carry, batch) -> (carry, out)`` once per step, in one ``lax.scan``: ``batch`` has
    the stacked arguments' rows of that step and the other arguments whole.

    ``out`` (member-major at each step: losses ``[n]``, aux ``[n, ...]``) comes back member-major
    over the steps too, ``[n, K, ...]``, like every other output of the library.
    """
    rows = tuple(b for b, flag in zip(batches, stacked) if flag)

    def body(carry: Any, row: tuple[Any, ...]) -> tuple[Any, Any]:
        it = iter(row)
        return one(carry, tuple(next(it) if flag else b for b, flag in zip(batches, stacked)))

    carry, outs = jax.lax.scan(body, carry, rows)
    return carry, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), outs)
