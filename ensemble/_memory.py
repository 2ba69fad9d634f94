"""Per-device memory you can print and compare, on CPU and GPU alike.

Two sources, both per device:

- :func:`live_memory`: what arrays *hold now*, summed from their ``addressable_shards``.
- :func:`compiled_memory`: what a jitted function *needs* on each device, from XLA's buffer
  assignment (``jax.jit(f).lower(*args).compile().memory_analysis()``): argument, output, temp
  and alias (donated) bytes, and the arrays compiled into the program as constants, with
  ``peak = argument + output + temp - alias + constants``. It needs no run, so it also works on
  ``jax.ShapeDtypeStruct`` arguments for models that would not fit.

``Device.memory_stats()`` (``bytes_in_use``, ``peak_bytes_in_use``) is added when the backend
gives it (GPU, TPU); it is ``None`` on CPU.

Example:
  >>> import jax, jax.numpy as jnp, ensemble
  >>> mesh = ensemble.make_mesh(jax.device_count())
  >>> x = ensemble.shard_members(jnp.zeros((jax.device_count(), 1000)), mesh, jax.device_count())
  >>> set(ensemble.live_memory(x).values())
  {4000}
  >>> stats = ensemble.compiled_memory(jax.jit(lambda a: a * 2, donate_argnums=0), x)
  >>> stats.argument, stats.alias
  (4000, 4000)
  >>> _ = ensemble.print_memory(stats)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import jax
import numpy as np

from ensemble._warn import warn_user

MB = 1e6  # tables use decimal megabytes: 1 MB = 10**6 bytes

# Device.memory_stats() keys shown (GPU/TPU), with their column names in the table.
_GPU_STAT_KEYS = {
    "bytes_in_use": "in_use",
    "peak_bytes_in_use": "peak_in_use",
    "bytes_limit": "limit",
}


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Per-device memory of one compiled (SPMD) program, in bytes.

    Under SPMD every device runs the same program on its own shard, so one set of numbers holds
    for each device in ``devices``.

    Attributes:
      argument: inputs the program reads (its shards of them).
      output: outputs it writes.
      temp: scratch buffers (activations, gradients, fusion temporaries).
      alias: output bytes that reuse donated input buffers.
      generated_code: compiled code size.
      xla_peak: XLA's own liveness-based peak estimate when the backend reports it, else 0.
        All sizes are XLA's: it counts sub-byte dtypes (int4, float4) packed, as GPUs and TPUs
        store them, although the CPU runtime stores one byte per element (``live_memory``
        reports what is stored).
      devices: devices the program runs on.
      device_stats: ``Device.memory_stats()`` subset (GPU/TPU) per device; empty on CPU.
      constants: arrays compiled into the program (values a jitted function closes over, such
        as ``lambda x: ens.apply(variables, x)``, and any copies XLA makes of them, such as a
        transpose for a gradient), which every device holds whole: neither sharded nor
        donated. Pass such values as arguments instead. Arrays XLA rebuilds in the program
        (zeros, ``arange``) cost none; from 1 MB on, :func:`compiled_memory` warns. On TPU,
        ``generated_code`` includes them too (the peak counts them once).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jax.ShapeDtypeStruct((1000,), jnp.float32)  # shapes suffice: nothing runs
      >>> kept = compiled_memory(jax.jit(lambda a: a * 2), x)
      >>> donated = compiled_memory(jax.jit(lambda a: a * 2, donate_argnums=0), x)
      >>> kept.peak, donated.peak  # the donated input's buffer holds the output
      (8000, 4000)
    """

    argument: int
    output: int
    temp: int
    alias: int
    generated_code: int = 0
    xla_peak: int = 0
    devices: tuple[jax.Device, ...] = ()
    device_stats: Mapping[jax.Device, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    constants: int = 0  # last: the fields before keep their positions

    @property
    def peak(self) -> int:
        """Peak estimate per device: argument + output + temp - alias (donated inputs reused)
        + constants."""
        return self.argument + self.output + self.temp - self.alias + self.constants

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (devices as strings)."""
        return {
            "argument": self.argument,
            "output": self.output,
            "temp": self.temp,
            "alias": self.alias,
            "constants": self.constants,
            "peak": self.peak,
            "generated_code": self.generated_code,
            "xla_peak": self.xla_peak,
            "devices": [str(d) for d in self.devices],
            "device_stats": {str(d): dict(s) for d, s in self.device_stats.items()},
        }


def _as_tree(tree: Any) -> Any:
    try:
        from flax import nnx

        if isinstance(tree, nnx.Module):
            return nnx.state(tree)
    except ImportError:  # pragma: no cover - flax is a dependency
        pass
    return tree


def live_memory(tree: Any = None) -> dict[jax.Device, int]:
    """Bytes each device holds for the arrays in ``tree`` (all live arrays when ``None``).

    Summed over ``addressable_shards`` (what really sits on each device, replicas included,
    each shard's ``on_device_size_in_bytes``, so packed sub-byte dtypes count as stored), so
    a replicated array counts once per device and a sharded one only by its shards. An array
    that appears twice in ``tree`` counts once; deleted (donated) arrays count zero. Every local
    device of the default backend appears, with 0 if it holds nothing.

    Args:
      tree: any pytree of ``jax.Array`` (linen variables, optax state, ``nnx.State``), or an
        ``nnx.Module``; ``None`` for every array in ``jax.live_arrays()``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jax.device_put(jnp.zeros((8, 1000)), jax.devices()[0])
      >>> live_memory({"x": x})[jax.devices()[0]]
      32000
    """
    if tree is None:
        arrays = list(jax.live_arrays())
    else:
        leaves = jax.tree_util.tree_leaves(_as_tree(tree))
        arrays = [x for x in leaves if isinstance(x, jax.Array)]
    out: dict[jax.Device, int] = {d: 0 for d in jax.local_devices()}
    # A buffer counts once, however many arrays show it: reading a sharded array's shards
    # makes one live array per shard, which jax.live_arrays() lists beside the array itself
    # (a second call counted them twice).
    seen: set[tuple[jax.Device, int]] = set()
    for a in arrays:
        if isinstance(a, jax.core.Tracer) or a.is_deleted():
            continue
        for shard in a.addressable_shards:
            buffer = (shard.device, _buffer_id(shard.data))
            if buffer not in seen:
                seen.add(buffer)
                out[shard.device] = out.get(shard.device, 0) + _nbytes(shard.data)
    return out


def _buffer_id(x: jax.Array) -> int:
    """The device buffer behind a single-device array (its own id where none can be read)."""
    try:
        return int(x.unsafe_buffer_pointer())
    except Exception:  # typed PRNG keys, backends without pointers
        return id(x)


def _nbytes(x: jax.Array) -> int:
    # What the runtime allocated, not size x itemsize: sub-byte dtypes (int4, float4) are packed
    # on GPU/TPU but NumPy's itemsize says one byte; typed keys count their key data.
    return int(x.on_device_size_in_bytes())


def _lowerer(fn: Callable[..., Any]) -> Callable[..., jax.stages.Lowered]:
    """How ``fn`` is lowered for its arguments: its own ``lower`` where it has one (a train
    step's bound ``scan`` through its step's ``lower(..., stacked=)``, as ``jax.jit(step.scan)``
    would trace ``stacked`` / ``carry`` and drop the step's donation: a peak 1.7x the real
    one), else ``jax.jit(fn)``'s."""
    return _own_lowerer(fn) or jax.jit(fn).lower


def _own_lowerer(fn: Any) -> Callable[..., jax.stages.Lowered] | None:
    from ensemble._nnx import NNXTrainStep
    from ensemble._train import TrainStep

    if hasattr(fn, "lower"):
        return fn.lower
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, TrainStep | NNXTrainStep) and fn.__func__ is type(owner).scan:
        return lambda *args, stacked=True, **kwargs: owner.lower(*args, stacked=stacked, **kwargs)
    inner = _own_lowerer(fn.func) if isinstance(fn, functools.partial) else None
    if inner is not None:  # functools.partial(step.scan, stacked=...) and the like
        return lambda *args, **kwargs: inner(*fn.args, *args, **{**fn.keywords, **kwargs})
    return None


def compiled_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CompiledMemory:
    """Per-device argument / output / temp / alias / peak bytes of ``fn(*args, **kwargs)``.

    ``fn`` may be jitted (``jax.jit``, ``nnx.jit``, an ensemble train step: anything with
    ``.lower``), with its donation and shardings, or a train step's ``scan`` (with its
    ``stacked=`` / ``carry=``; lowered as ``step.lower(..., stacked=...)``, donation kept), or a
    plain function (then ``jax.jit(fn)``, no donation), or an already lowered / compiled
    program (``ens.lower_init(key, x)``; then no arguments). Only lowering and compiling
    happen: nothing runs and donated arguments stay valid, and ``args`` may be
    ``jax.ShapeDtypeStruct`` (with ``sharding=``) instead of arrays.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> step = jax.jit(lambda w: w - 0.1, donate_argnums=0)
      >>> s = compiled_memory(step, jnp.zeros(1000))
      >>> (s.argument, s.output, s.alias, s.peak)
      (4000, 4000, 4000, 4000)
    """
    if callable(fn) and not _is_function(fn):
        # jax.jit(module) closes over its state: compiled in as constants, the state's bytes
        # missing from every figure (and the whole ensemble's weights in each device's program).
        raise TypeError(
            f"compiled_memory: fn is an nnx.Module ({type(fn).__name__}), whose state jax.jit "
            "would compile in as constants, missing from the figures; pass it as an argument "
            "of a jitted function instead: compiled_memory(nnx.jit(lambda m, x: m(x)), ens, x)."
        )
    try:
        if isinstance(fn, jax.stages.Compiled):
            compiled = fn
        elif isinstance(fn, jax.stages.Lowered):  # e.g. ens.lower_init(key, x)
            compiled = fn.compile()
        else:
            compiled = _lowerer(fn)(*args, **kwargs).compile()
    except Exception as e:  # re-raised with what to do; the original stays chained
        msg = (
            f"compiled_memory could not lower/compile {getattr(fn, '__name__', fn)!r} for the "
            f"given arguments: {str(e).rstrip('.')}. Pass the same arguments you would call it "
            "with (arrays or jax.ShapeDtypeStruct)."
        )
        try:
            err = type(e)(msg)
        except Exception:  # an exception type with another constructor
            err = RuntimeError(msg)
        raise err from e
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(
            "this backend gives no compiled memory analysis (memory_analysis() is None); use "
            "live_memory() on the arrays instead."
        )
    devices = _compiled_devices(compiled)
    constants = _constant_bytes(compiled.as_text() or "")  # None where a backend has no text
    if constants >= _CONSTANTS_WARN:
        warn_user(
            f"compiled_memory: the program holds {constants / MB:.1f} MB of constants on every "
            "device, from arrays the jitted function closes over (such as every member's "
            "weights in lambda x: ens.apply(variables, x)), neither sharded nor donated; pass "
            "them as arguments: compiled_memory(jax.jit(lambda v, x: ens.apply(v, x)), "
            "variables, x)."
        )
    return CompiledMemory(
        argument=int(stats.argument_size_in_bytes),
        output=int(stats.output_size_in_bytes),
        temp=int(stats.temp_size_in_bytes),
        alias=int(stats.alias_size_in_bytes),
        constants=constants,
        generated_code=int(stats.generated_code_size_in_bytes),
        xla_peak=int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
        devices=devices,
        device_stats=_device_stats(devices),
    )


# An array constant of the compiled (per-device) HLO: `%c = f32[8,512]{1,0} constant({...})`;
# not scalars, which the compiled code holds as immediates.
_HLO_CONSTANT = re.compile(r"= ([a-z]+[0-9a-z]*)\[([0-9,]+)\]\S* constant\(")
_CONSTANTS_WARN = 1_000_000  # bytes: a closed-over array, not XLA's own small tables


def _constant_bytes(hlo: str) -> int:
    """Bytes of the array constants in a compiled program's HLO text (XLA's sizes: sub-byte
    dtypes packed). Memory analysis leaves them out of its argument / output / temp figures
    (on TPU its code size has them), and a closure over sharded arrays puts every shard in
    each device's program."""
    total = 0
    for dtype, dims in _HLO_CONSTANT.findall(hlo):
        bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
        total += math.ceil(math.prod(int(d) for d in dims.split(",") if d) * bits / 8)
    return total


def _compiled_devices(compiled: Any) -> tuple[jax.Device, ...]:
    shardings = jax.tree_util.tree_leaves((compiled.input_shardings, compiled.output_shardings))
    found: set[jax.Device] = set()
    for s in shardings:
        found.update(getattr(s, "device_set", ()))
    # Across processes a program spans every process's devices; each reports its own.
    found = {d for d in found if d.process_index == jax.process_index()}
    if not found:  # a function of no arrays still runs on the default device
        found = {jax.local_devices()[0]}
    return tuple(sorted(found, key=lambda d: (d.platform, d.id)))


def _device_stats(devices: tuple[jax.Device, ...]) -> dict[jax.Device, dict[str, int]]:
    out = {}
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if stats:
            out[d] = {k: int(stats[k]) for k in _GPU_STAT_KEYS if k in stats}
    return out


def _format_live(mem: Mapping[jax.Device, int], title: str) -> str:
    rows = [(str(d), f"{b / MB:10.3f}") for d, b in mem.items()]
    total = sum(mem.values())
    rows.append(("total", f"{total / MB:10.3f}"))
    return _table(title, ("device", "live MB"), rows)


def _format_compiled(stats: CompiledMemory, title: str) -> str:
    cols = ["device", "argument", "output", "temp", "alias", "const", "peak", "code"]
    present = {k for s in stats.device_stats.values() for k in s}
    gpu_keys = [k for k in _GPU_STAT_KEYS if k in present]
    cols += [_GPU_STAT_KEYS[k] for k in gpu_keys]  # what the device holds now, not this program
    rows = []
    for d in stats.devices:
        values = [stats.argument, stats.output, stats.temp, stats.alias, stats.constants]
        values.append(stats.peak)
        values.append(stats.generated_code)
        values += [stats.device_stats.get(d, {}).get(k, 0) for k in gpu_keys]
        rows.append((str(d), *(f"{v / MB:10.3f}" for v in values)))
    note = "; in_use/peak_in_use: device memory_stats() now" if gpu_keys else ""
    title += f" (MB per device; peak = argument + output + temp - alias + const{note})"
    return _table(title, cols, rows)


def _table(title: str, header: tuple[str, ...] | list[str], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in [tuple(header), *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))
    sep = "-" * len(line(tuple(header)))
    return "\n".join([title, line(tuple(header)), sep, *(line(r) for r in rows)])


def print_memory(
    what: Any = None,
    *args: Any,
    title: str | None = None,
    file: TextIO | None = None,
    **kwargs: Any,
) -> str:
    """Prints a per-device memory table (MB) and returns it as a string.

    ``what`` may be:

    - a :class:`CompiledMemory` (from :func:`compiled_memory`): argument / output / temp /
      alias / const / peak / code per device, plus GPU ``memory_stats`` columns when present;
    - a lowered or compiled program (``ens.lower_init(key, x)``, ``jax.jit(f).lower(x)``);
    - a jitted function followed by its arguments: ``print_memory(step, params, opt, batch)``
      compiles it (without running) and prints the same table;
    - a dict ``{device: bytes}`` (from :func:`live_memory`);
    - any pytree of arrays or an ``nnx.Module``: its live bytes per device;
    - ``None``: live bytes of every array JAX holds.

    Example:
      >>> import jax.numpy as jnp
      >>> table = print_memory({"w": jnp.zeros((8, 1000))}, title="w", file=None)  # doctest: +SKIP
    """
    if isinstance(what, CompiledMemory):
        text = _format_compiled(what, title or "compiled memory")
    elif isinstance(what, jax.stages.Lowered | jax.stages.Compiled):  # e.g. ens.lower_init(k, x)
        text = _format_compiled(compiled_memory(what), title or "compiled program")
    elif _is_function(what) and (args or kwargs or hasattr(what, "lower")):
        name = getattr(what, "__name__", type(what).__name__)
        text = _format_compiled(compiled_memory(what, *args, **kwargs), title or name)
    else:
        if args or kwargs:
            raise TypeError(
                "extra arguments are only for a function to compile: print_memory(fn, *args)."
            )
        by_device = (
            isinstance(what, Mapping) and what and all(isinstance(k, jax.Device) for k in what)
        )
        mem = dict(what) if by_device else live_memory(what)
        text = _format_live(mem, title or ("all live arrays" if what is None else "live arrays"))
        if what is not None and not by_device:
            text += _host_note(what)
    print(text, file=file if file is not None else sys.stdout)
    return text


def _host_note(tree: Any) -> str:
    """Lines for the tree's host (NumPy) arrays and shapes alone (``ShapeDtypeStruct``), which
    no device holds: without them such a tree reads as 0 MB everywhere, as if it were empty."""
    leaves = jax.tree_util.tree_leaves(_as_tree(tree))
    host = [x for x in leaves if isinstance(x, np.ndarray | np.generic)]  # scalars too
    shapes = [x for x in leaves if isinstance(x, jax.ShapeDtypeStruct)]
    text = ""
    if host:
        mb = sum(np.asarray(x).nbytes for x in host) / MB
        text += f"\n+ {len(host)} host (NumPy) array(s), {mb:.3f} MB, on no device"
    if shapes:
        mb = sum(math.prod(x.shape) * x.dtype.itemsize for x in shapes) / MB
        text += (
            f"\n+ {len(shapes)} ShapeDtypeStruct(s), {mb:.3f} MB in all, shapes only (no "
            "memory): for a program's memory use compiled_memory"
        )
    return text


def _is_function(x: Any) -> bool:
    if not callable(x):
        return False
    try:
        from flax import nnx

        return not isinstance(x, nnx.Module)  # a Module is state to measure, not a step
    except ImportError:  # pragma: no cover
        return True
