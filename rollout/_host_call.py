"""``host_call``: a side-effecting NumPy callback from inside ``jit``, without JAX's per-call tax.

``jax.experimental.io_callback`` wraps every argument of every call in a JAX array
(``device_put`` onto the CPU device) before the callback sees it. For a callback made once per
env step that wrapping IS the cost: measured on a 2-core machine, a no-op ``io_callback`` inside
a ``lax.scan`` took 57 us per step on one device and 380 us per device with two devices calling
at once (the ``device_put``\\ s contend with the running programs); the same callback handed
XLA's NumPy buffers directly took 6 us and 49 us.

``host_call`` is that direct path: a primitive with ``io_callback``'s own IO effect (so JAX
keeps, orders and never deduplicates it exactly as it does ``io_callback``: allowed in ``scan``,
``while`` and ``shard_map``, never removed as dead code), lowered through the same Python-callback
custom call marked side-effecting, but calling ``fn`` with the NumPy views XLA passes. It needs
three names from ``jax._src`` (the effect, the callback emitter, and its sharding helper); where
they are missing (a JAX release that moved them), ``host_call`` falls back to ``io_callback``
with the arguments converted to NumPy: slower, same results. ``FAST`` says which is in use.

``fn`` receives read-only NumPy arrays valid only during the call (copy what you keep) and must
return a tuple of arrays matching ``result_types`` exactly in shape and dtype.

Results of a callback go to the device in ranks made equal (:func:`equal_ranks`): on a TPU, JAX
0.10.2 lowers a callback inside ``shard_map`` to one host receive per result, each annotated
with the sharding of the first result, so a result of another rank fails to verify ("sharding
doesn't match tensor rank"). Trailing axes of size 1, added on the host and dropped in the
program, cost nothing (a reshape of contiguous data).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

try:  # the three private pieces the fast path needs (see the module docstring)
    from jax._src import core as _core
    from jax._src.callback import _callback_op_sharding, _IOEffect, emit_python_callback
    from jax._src.interpreters import mlir as _mlir
except ImportError:  # pragma: no cover - depends on the JAX release
    _core = None

FAST = _core is not None


def _numpy_call(fn: Callable[..., Any]) -> Callable[..., tuple]:
    def call(*args: Any) -> tuple:
        return tuple(fn(*(np.asarray(a) for a in args)))

    return call


if FAST:
    _host_call_p = _core.Primitive("host_call")
    _host_call_p.multiple_results = True

    @_host_call_p.def_effectful_abstract_eval
    def _abstract_eval(*avals: Any, fn: Any, result_avals: tuple) -> tuple:
        del avals, fn
        return result_avals, {_IOEffect}

    def _lowering(ctx: Any, *args: Any, fn: Any, result_avals: tuple) -> Sequence[Any]:
        del result_avals
        sharding = _callback_op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
        result, _, _ = emit_python_callback(
            ctx,
            lambda *xs: tuple(fn(*xs)),
            None,
            list(args),
            ctx.avals_in,
            ctx.avals_out,
            has_side_effect=True,
            returns_token=False,
            sharding=sharding,
        )
        return result

    # Not cacheable: the lowering embeds this call's own Python function.
    _mlir.register_lowering(_host_call_p, _lowering, cacheable=False)

    @_host_call_p.def_impl
    def _impl(*args: Any, fn: Any, result_avals: tuple) -> list:
        del result_avals
        return [jax.numpy.asarray(x) for x in _numpy_call(fn)(*args)]


def equal_ranks(types: Sequence[Any]) -> tuple[list[jax.ShapeDtypeStruct], list[int]]:
    """``types`` with trailing axes of size 1 up to the highest rank, and how many each got.

    A callback's host function is wrapped by :func:`pad_results` and the traced code gets the
    originals back from :func:`drop_padding` (see the module docstring for why). Trailing, so
    batch axes that ``vmap`` puts in front keep their place.

    >>> import jax, numpy as np
    >>> padded, pads = equal_ranks([jax.ShapeDtypeStruct((4, 3), np.float32),
    ...                             jax.ShapeDtypeStruct((4,), np.bool_)])
    >>> [t.shape for t in padded], pads
    ([(4, 3), (4, 1)], [0, 1])
    """
    rank = max((len(t.shape) for t in types), default=0)
    pads = [rank - len(t.shape) for t in types]
    return [jax.ShapeDtypeStruct((*t.shape, *(1,) * k), t.dtype) for t, k in zip(types, pads)], pads


def pad_results(fn: Callable[..., Any], pads: Sequence[int]) -> Callable[..., Any]:
    """The host's side of :func:`equal_ranks`: ``fn`` with its results' trailing axes added
    (``fn`` itself where none are)."""
    if not any(pads):
        return fn
    return lambda *xs: [
        np.reshape(o, np.shape(o) + (1,) * k) if k else o for o, k in zip(fn(*xs), pads)
    ]


def drop_padding(outs: Sequence[Any], pads: Sequence[int]) -> list[Any]:
    """The program's side of :func:`equal_ranks`: the trailing axes taken off again."""
    return [o.reshape(o.shape[: o.ndim - k]) if k else o for o, k in zip(outs, pads)]


# Sub-byte dtypes, and the byte-wide ones that hold each of their values exactly.
_SUB_BYTE = {
    "int2": np.int8, "uint2": np.uint8, "int4": np.int8, "uint4": np.uint8,
    "float4_e2m1fn": np.float32,
}  # fmt: skip


def widen_sub_byte(xs: Sequence[jax.Array]) -> tuple[list[jax.Array], list[Any]]:
    """``xs`` with sub-byte arrays (int4, ...) cast to a byte-wide dtype, and the dtypes to
    give them back on the host (``None``: unchanged). A callback of a program over several
    CPU devices gets sub-byte inputs as ``jax.Array``s, whose conversion to NumPy is a JAX
    computation on those devices, which waits forever for the program that called back.

    >>> import jax.numpy as jnp
    >>> [x.dtype for x in widen_sub_byte([jnp.zeros(2, jnp.int4), jnp.zeros(2)])[0]]
    [dtype('int8'), dtype('float32')]
    """
    back = [np.dtype(x.dtype) if np.dtype(x.dtype).name in _SUB_BYTE else None for x in xs]
    wide = [x if b is None else x.astype(_SUB_BYTE[b.name]) for x, b in zip(xs, back)]
    return wide, back


def restore_sub_byte(xs: Sequence[Any], back: Sequence[Any]) -> list[Any]:
    """The other side of :func:`widen_sub_byte`: ``xs`` in their dtypes again (``back``)."""
    return [x if b is None else x.astype(b) for x, b in zip(xs, back)]


def narrow_sub_byte(fn: Callable[..., Any], back: Sequence[Any]) -> Callable[..., Any]:
    """The host's side of :func:`widen_sub_byte`: ``fn`` given its inputs in their dtypes."""
    if all(b is None for b in back):
        return fn
    return lambda *xs: fn(*restore_sub_byte([np.asarray(x) for x in xs], back))


def host_call(fn: Callable[..., Any], result_types: Sequence[Any], *args: jax.Array) -> tuple:
    """Calls ``fn(*numpy_args) -> tuple of arrays`` on the host from traced code, as an IO effect.

    Like ``io_callback(..., ordered=False)``: kept even if its results are unused, never merged
    with another call nor run twice; calls are ordered only by data dependence. Not
    differentiable and not vmappable (both raise). Outside ``jit`` it runs ``fn`` directly.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> out = jax.jit(lambda x: host_call(lambda a: (a * 2,), [x], x))(jnp.arange(3.0))
    >>> np.asarray(out[0])
    array([0., 2., 4.], dtype=float32)
    """
    types, pads = equal_ranks(result_types)
    padded = pad_results(fn, pads)
    if not FAST:  # pragma: no cover - depends on the JAX release
        from jax.experimental import io_callback

        outs = io_callback(_numpy_call(padded), types, *args, ordered=False)
    else:
        avals = tuple(_core.ShapedArray(t.shape, np.dtype(t.dtype)) for t in types)
        outs = _host_call_p.bind(*args, fn=padded, result_avals=avals)
    return tuple(drop_padding(outs, pads))
