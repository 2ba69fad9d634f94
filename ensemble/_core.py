"""Member execution: the one mechanism that runs a per-member function for every member.

Every per-member computation of the library (linen init and apply, the train steps, the NNX
module call, the PPO update) goes through :meth:`Members.map`. It runs the plain single-member
function under ``jax.shard_map`` with the member axis ``'ensemble'`` *manual*:

- each device receives only its own members' slices: several members on one device are vmapped
  (or, for initialisation, run one after another) inside that device's program; one member per
  device is vmapped over an axis of 1 (which keeps donated buffers in place), except for
  gradients, which run the plain function on the member's slices (see ``_device_program``);
- the within-member axes ``'data'`` and ``'model'`` stay automatic: constraints inside a member
  (Flax logical annotations, ``with_sharding_constraint``) resolve through Flax's own functions
  against the mesh that ``shard_map`` puts in context, so the compiler splits a member over its
  devices exactly as it would split the plain model.

Why not ``jax.vmap(..., spmd_axis_name='ensemble')`` under ``jit``: that leaves the member axis to
the compiler's partitioner, which may gather every member's kernels and activations onto each
device (a conv net's train step then does not shrink per device) and, for a vmapped conv (a
grouped conv once the kernel is batched), returns wrong numbers or fails to compile on small
feature maps (``tests/test_zoo.py`` holds the cases). With a manual member axis no operation can
cross members: the compiled program has no collective on that axis by construction.

Also here, written once for linen and NNX: input axes, rng streams and member keys, the split of
inputs into traced arrays and static Python values, checks on member-major and donated inputs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ensemble._grouped_convs import warn_of_grouped_convs_over_data_and_model
from ensemble._mesh import DATA_AXIS, MEMBER_AXIS, LogicalRules, check_rules, own_mesh
from ensemble._warn import warn_user

InAxes = int | None | Sequence[int | None]
Axes = tuple[int | None, ...]


# ------------------------------------------------------------------------------------------------
# Inputs: axes, keyword arguments, keys, checks
# ------------------------------------------------------------------------------------------------


def check_in_axes(in_axes: Any) -> InAxes:
    """``None`` (shared), ``0`` (per-member, leading axis n) or a tuple of those per input."""
    ok = lambda a: a is None or (isinstance(a, int) and not isinstance(a, bool) and a == 0)
    if ok(in_axes):
        return in_axes
    if isinstance(in_axes, list | tuple) and all(ok(a) for a in in_axes):
        return tuple(in_axes)
    raise ValueError(
        "in_axes must be None (inputs shared by all members), 0 (per-member inputs with a "
        f"leading axis of size n) or a tuple of those, one per positional input; got {in_axes!r}."
    )


def batch_default(in_axes: InAxes) -> bool:
    """``per_member_batch`` of a train step made for an ensemble without one: what the
    ensemble's ``in_axes`` say its inputs are. A batch with a leading axis of n taken as shared
    would train every member on all n slices without an error, so an ensemble built for
    per-member inputs trains on per-member batches unless told otherwise."""
    if in_axes is None or isinstance(in_axes, int):
        return in_axes == 0
    raise ValueError(
        f"this ensemble's in_axes={tuple(in_axes)} say which of its model's inputs are "
        "per-member, not which of the loss's batch arguments are: pass per_member_batch= "
        "(True, False or one flag per batch argument)."
    )


def arg_axes(in_axes: InAxes, count: int) -> Axes:
    """One axis (0 or None) per positional input."""
    if in_axes is None or isinstance(in_axes, int):
        return (in_axes,) * count
    axes = tuple(in_axes)
    if len(axes) != count:
        raise ValueError(
            f"in_axes={axes} gives {len(axes)} axes but {count} positional input(s) were "
            "passed; give one axis (None or 0) per positional input."
        )
    return axes


def split_static(tree: Any, what: str, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``(arrays, rest)``: the array leaves of ``tree`` (traced) and everything else (static,
    hashable, part of a cache key), as ``model.apply`` would see them: ``train=True``, a mode
    string or a dict of settings stays a Python value, so ``if train:`` works in the module.
    :func:`join_static` puts them back together. Refuses an unhashable non-array leaf."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    # Shape structs too: lower_init / init_shardings / compiled_memory take them for arrays.
    mask = tuple(isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct) for _, x in leaves)
    fixed = tuple(None if d else x for (_, x), d in zip(leaves, mask))
    for path, x in (leaf for leaf, d in zip(leaves, mask) if not d):
        try:
            hash(x)
        except TypeError:
            raise TypeError(
                f"{what}{jax.tree_util.keystr(path)} = {x!r} is neither an array (traced) nor "
                "hashable (static); pass arrays, or hashable Python values such as bools, "
                "numbers, strings and tuples."
            ) from None
    static = (treedef, mask, fixed, typed(fixed))  # typed: 1, 1.0 and True compile apart
    try:
        hash(static)
    except TypeError:
        raise TypeError(f"{what} is a pytree whose structure is not hashable: {treedef}") from None
    return [x for (_, x), d in zip(leaves, mask) if d], static


def join_static(arrays: Sequence[Any], static: Any) -> Any:
    """The tree that :func:`split_static` split, with ``arrays`` (traced or not) in place."""
    treedef, mask, fixed, _ = static
    it = iter(arrays)
    leaves = [next(it) if d else x for x, d in zip(fixed, mask)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def typed(value: Any) -> Hashable:
    """``value`` with the type of every part: a cache key under which ``1``, ``1.0`` and
    ``True`` (equal in Python) stay apart, as the programs they make differ in dtype; so do
    ``-0.0`` and ``0.0`` of any float type (``x / -0.0`` is ``-inf``; numpy, bfloat16 and
    float8 scalars included), also inside a frozen dataclass (``Cfg(scale=1)`` and
    ``Cfg(scale=1.0)``)."""
    if isinstance(value, tuple | list):
        return type(value), tuple(typed(v) for v in value)
    if isinstance(value, dict):
        return type(value), tuple((k, typed(v)) for k, v in value.items())
    if isinstance(value, frozenset):
        return type(value), frozenset(typed(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return type(value), tuple((f.name, typed(getattr(value, f.name))) for f in fields)
    if isinstance(value, float | complex) or (
        isinstance(value, np.generic) and jnp.issubdtype(value.dtype, jnp.inexact)
    ):  # numpy and ml_dtypes (bfloat16, float8) scalars too
        return type(value), repr(value)  # the sign of a zero
    return type(value), value


def split_loss(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``(loss, aux)`` of one member's ``loss_fn`` output (``aux`` None without ``has_aux``),
    checked: a pair with ``has_aux``, no tuple without it, a scalar loss."""
    if has_aux and not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError("with has_aux=True, loss_fn must return (loss, aux).")
    if not has_aux and isinstance(out, tuple):
        raise ValueError(
            "loss_fn returned a tuple; return the loss alone, or (loss, aux) with has_aux=True."
        )
    loss, aux = out if has_aux else (out, None)
    if np.shape(loss) != ():
        raise ValueError(
            "loss_fn must return a scalar loss per member (it sees one member); got shape "
            f"{np.shape(loss)}. Reduce it, e.g. with jnp.mean."
        )
    return loss, aux


def abstract_signature(tree: Any) -> Hashable:
    """Tree structure, shapes and dtypes: what a compiled program depends on."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)


@functools.lru_cache
def _legacy_key_shape(impl: str) -> tuple[int, ...]:
    """The shape of ``jax.random.PRNGKey(0)`` under the default generator ``impl``."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def as_key(value: Any, name: str = "rng") -> jax.Array:
    """An int seed, a typed key or a legacy ``PRNGKey`` -> one typed key."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return jax.random.key(int(value))
    if isinstance(value, jax.Array | np.ndarray):
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key) and value.shape == ():
            return value
        if value.dtype == np.uint32 and value.shape == _legacy_key_shape(
            jax.config.jax_default_prng_impl
        ):  # a legacy PRNGKey: (2,) under threefry, (4,) under rbg
            return jax.random.wrap_key_data(jnp.asarray(value))
    raise TypeError(
        f"rng stream {name!r} must be one key (jax.random.key(0) or jax.random.PRNGKey(0)) or an "
        f"int seed; got {type(value).__name__} {getattr(value, 'shape', '')}."
    )


def stream_keys(rngs: Any, default: str | None, mesh: Mesh) -> dict[str, jax.Array]:
    """A key, seed or ``{stream: key}`` -> ``{stream: typed key}`` for an ensemble on
    ``mesh``."""
    if isinstance(rngs, Mapping):
        return {str(k): key_on(as_key(v, str(k)), mesh) for k, v in rngs.items()}
    if default is None:
        raise TypeError("rngs= must be a dict of keys per stream, e.g. {'dropout': key}.")
    return {default: key_on(as_key(rngs, default), mesh)}


def key_on(key: jax.Array, mesh: Mesh) -> jax.Array:
    """A key committed elsewhere (made under a caller's mesh, or put on one device), whole on
    each of its devices, re-placed onto the ensemble's ``mesh``: a jit refuses arguments on two
    device lists. The same key: only where it lives changes."""
    if isinstance(key, jax.core.Tracer) or not isinstance(key, jax.Array) or not key.committed:
        return key
    sharding = key.sharding
    on_mesh = isinstance(sharding, NamedSharding) and sharding.mesh == mesh
    if on_mesh or not sharding.is_fully_replicated:
        return key
    return jax.device_put(key, NamedSharding(mesh, PartitionSpec()))


def first_failing(tree: Any, bad: Callable[[Any], bool]) -> tuple[str, Any] | None:
    """The path (``keystr``) and leaf of the first leaf of ``tree`` that is ``bad``, else None.

    The checks below run on every call of a step, over every leaf: paths, the slow part, are
    made only for a tree that has a bad leaf (a model of 600 leaves spent 5 ms a call on them).
    """
    if not any(bad(leaf) for leaf in jax.tree_util.tree_leaves(tree)):
        return None
    path, leaf = next((p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree) if bad(x))
    return jax.tree_util.keystr(path), leaf


def check_member_major(tree: Any, n: int, what: str, hint: str = "") -> None:
    """Every leaf has a leading member axis of size n; otherwise one clear error."""
    found = first_failing(tree, lambda leaf: np.shape(leaf)[:1] != (n,))
    if found is not None:
        path, leaf = found
        raise ValueError(
            f"{what}{path} has shape {np.shape(leaf)}; it needs a leading "
            f"member axis of size n={n}.{' ' + hint if hint else ''}"
        )


# How to fix an input marked per-member / shared that does not look like one.
INPUT_FIXES = (
    "Stack one input per member, or build the ensemble with in_axes=None for a shared input.",
    "Build the ensemble with in_axes=0 (or 0 at this position) to give member i slice i.",
)
BATCH_FIXES = (
    "Use per_member_batch=False (or False for this argument) for a batch shared by all members.",
    "Use per_member_batch=True (or True for this argument) to give member i slice i.",
)


def check_inputs(
    args: Sequence[Any],
    axes: Axes,
    n: int,
    what: str,
    per_member_fix: str,
    shared_fix: str,
    mesh: Mesh,
) -> None:
    """Inputs of a member call, by their axis: per-member ones (0) have a leading member axis
    of n; shared ones (None) are not laid out one slice per member; none is committed to
    devices other than the mesh's."""
    for pos, (arg, ax) in enumerate(zip(args, axes)):
        if ax == 0:
            check_no_python_values(arg, f"{what} {pos} (per-member)", per_member_fix)
            check_member_major(arg, n, f"{what} {pos} (per-member)", per_member_fix)
        else:
            check_shared(arg, n, f"{what} {pos}", shared_fix)
        check_on_mesh(arg, mesh, f"{what} {pos}", member_major=ax == 0)


def check_stacked_inputs(
    batches: Sequence[Any],
    stacked: Sequence[bool],
    axes: Axes,
    n: int,
    shared_fix: str,
    mesh: Mesh,
) -> None:
    """:func:`check_inputs`' placement checks for a scan's stacked batch arguments, whose
    one-step rows (the shape structs ``check_inputs`` sees) carry no placement: none committed
    to other devices, and a shared one not laid out one slice per member on its member axis
    (axis 1, after the steps)."""
    for pos, (arg, flag, ax) in enumerate(zip(batches, stacked, axes)):
        if flag:
            check_on_mesh(arg, mesh, f"batch argument {pos}")
            if ax is None:
                check_shared(arg, n, f"batch argument {pos}", shared_fix, axis=1)


def check_no_python_values(tree: Any, what: str, hint: str) -> None:
    """Refuses a Python value (a bool, a number, a list of n numbers) in a per-member input.
    Python values are static: every member would get all of it, not its own part (NNX gave
    each member the whole per-member array beside it, a silent wrong number), so a per-member
    input must be arrays only."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):  # arrays, specs
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} = {leaf!r} is a Python value, not an "
                "array, so it has no member axis: per-member values must be arrays with a "
                "leading axis of n (jnp.asarray(...)); a value shared by all members goes at a "
                f"position with in_axes=None (e.g. in_axes=(0, None)) or as a keyword. {hint}"
            )


def check_shared_kwargs(kwargs: Mapping[str, Any], n: int, mesh: Mesh) -> None:
    """Keyword inputs of a member call are shared by all members (both adapters): refuses one
    laid out one slice per member, like a shared positional input."""
    for name in sorted(kwargs):
        check_shared(
            kwargs[name],
            n,
            f"keyword input {name!r}",
            "Keyword inputs are shared by all members: pass per-member data as a positional "
            "input, with in_axes=0 at its position.",
        )
        check_on_mesh(kwargs[name], mesh, f"keyword input {name!r}")


def _device_ids(devices: Any) -> str:
    ids = sorted(d.id for d in devices)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}"
    return ", ".join(map(str, ids))


def check_on_mesh(tree: Any, mesh: Mesh, what: str, member_major: bool = False) -> None:
    """Refuses an array committed to devices other than the ensemble's (one device, say, after
    ``ens.member(v, i)`` or a gather), or to the same devices in another order (another
    ensemble's mesh): a compiled call cannot take it, and JAX's own error names no fix.
    Uncommitted arrays (numpy, ``jnp.ones``) are placed by the call itself. ``member_major``:
    the tree has a leading member axis (params, optimizer state), which the fix keeps split."""
    order = None

    def misplaced(leaf: Any) -> bool:
        nonlocal order
        if isinstance(leaf, jax.core.Tracer):  # inside the caller's jit: its type's sharding
            return _explicit_elsewhere(getattr(jax.typeof(leaf), "sharding", None), mesh)
        if not isinstance(leaf, jax.Array):
            return False
        sharding = leaf.sharding
        if getattr(sharding, "mesh", None) is mesh:  # the usual case, in O(1)
            return False
        if not leaf.committed or leaf.is_deleted():
            return False
        order = tuple(mesh.devices.flat) if order is None else order
        if sharding.device_set != set(order) or _explicit_elsewhere(sharding, mesh):
            return True
        # Same devices, another order: jit refuses to mix device assignments.
        other = getattr(sharding, "mesh", None)
        return len(order) > 1 and other is not None and tuple(other.devices.flat) != order

    found = first_failing(tree, misplaced)
    if found is None:
        return
    path, leaf = found
    if isinstance(leaf, jax.core.Tracer):  # traced: nothing to put, but replicate it first
        sharding = jax.typeof(leaf).sharding
        raise ValueError(
            f"{what}{path} is split on a mesh with Explicit axes of its own "
            f"({sharding.mesh.axis_names}, {sharding.spec}), which JAX cannot take into this "
            "ensemble's mesh; replicate it on yours first: jax.sharding.reshard(x, "
            "jax.sharding.NamedSharding(your_mesh, jax.sharding.PartitionSpec()))."
        )
    # (a scalar, such as an optimizer's step count, has no member axis to keep split)
    _refuse_placement(f"{what}{path}", leaf, mesh, order, member_major and leaf.ndim > 0)


def _refuse_placement(
    what: str, leaf: jax.Array, mesh: Mesh, order: Any, member_major: bool
) -> None:
    """:func:`check_on_mesh`'s one line for a committed array: where it is, and the fix."""
    sharding = leaf.sharding
    fix = (
        "(ensemble.sharding.shard_members(x, ens.mesh, ens.n), which keeps the members split)"
        if member_major
        else "(jax.device_put(x, jax.sharding.NamedSharding(ens.mesh, "
        "jax.sharding.PartitionSpec())))"
    )
    if _explicit_elsewhere(sharding, mesh):
        where = (
            f"is split on a mesh with Explicit axes of its own ({sharding.mesh.axis_names}, "
            f"{sharding.spec}), which JAX cannot take into this ensemble's mesh"
        )
    elif sharding.device_set == set(order):
        where = (
            f"is on this ensemble's devices ({_device_ids(order)}) in another order (another "
            "mesh's), which a compiled call cannot mix with this one's"
        )
    else:
        where = (
            f"is committed to device(s) {_device_ids(sharding.device_set)}, but this "
            f"ensemble runs on devices {_device_ids(order)}"
        )
    uncommitted = (
        ""
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        else ("pass it uncommitted (np.asarray(x)) or ")
    )  # (a typed key has no NumPy form)
    raise ValueError(f"{what} {where}; {uncommitted}move it there {fix}.")


def _explicit_elsewhere(sharding: Any, mesh: Mesh) -> bool:
    """Split over an Explicit axis of another mesh (``jax.make_mesh``'s default) that this
    ensemble's mesh does not have: JAX's shard_map then fails with a bare KeyError naming that
    axis (one it has, a user's ``'data'``, JAX takes)."""
    other = getattr(sharding, "mesh", None)
    if other is None or other == mesh:
        return False
    explicit = {
        name
        for name, kind in zip(other.axis_names, other.axis_types)
        if kind == jax.sharding.AxisType.Explicit
    }
    used = {a for part in sharding.spec for a in (part if isinstance(part, tuple) else (part,))}
    return bool((explicit & used) - set(mesh.axis_names))


def check_shared(tree: Any, n: int, what: str, hint: str, axis: int = 0) -> None:
    """Refuses a shared input (every member sees all of it) that is laid out one slice per
    member: an axis of n (``axis``: the leading one, the second for a scan's stacked steps)
    split over the member devices. Such an array is almost surely per-member data marked
    shared, and a loss that broadcasts it would train every member on every member's slice
    without an error."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            continue
        sharding, shape = leaf.sharding, np.shape(leaf)
        if not (isinstance(sharding, NamedSharding) and len(shape) > axis and shape[axis] == n):
            continue
        first = sharding.spec[axis] if len(sharding.spec) > axis else None
        names = first if isinstance(first, tuple) else (first,)
        if MEMBER_AXIS in names and sharding.mesh.shape.get(MEMBER_AXIS, 1) > 1:
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} is shared by all members, but it has "
                f"{'a leading axis' if axis == 0 else f'an axis {axis}'} of n={n} "
                f"split over the {MEMBER_AXIS!r} devices, one slice per "
                f"member. {hint}"
            )


def check_not_donated(
    batch: Sequence[Any], donated: Any, donated_what: str, donating: bool = True
) -> None:
    """Refuses what would make XLA touch a buffer it no longer owns (on the CPU backend a crash
    inside XLA, not an error): a batch argument whose buffer an earlier call donated, and, when
    this call donates, a batch argument that is one of the donated arrays or an array that
    appears twice among them (tied weights: XLA would donate the one buffer twice). ``donated``:
    a dict naming its parts (``{"params": ..., "opt_state": ...}``), as the messages do."""
    keep_a_copy = (
        "keep a copy made once before the loop, e.g. anchor = jax.tree.map(jnp.copy, params)"
    )
    for pos, arg in enumerate(batch):
        check_live(arg, f"batch argument {pos}", fix=keep_a_copy)
    if not donating:
        return
    ids = [id(x) for x in jax.tree_util.tree_leaves(donated) if _concrete(x)]
    if len(set(ids)) < len(ids):  # paths (slow) only to name the pair
        seen: dict[int, str] = {}
        for path, leaf in jax.tree_util.tree_leaves_with_path(donated):
            if _concrete(leaf):
                where = jax.tree_util.keystr(path)
                if id(leaf) in seen:
                    raise ValueError(
                        f"{where} is the same array as {seen[id(leaf)]} (both donated); a "
                        "donating step needs each array once (it overwrites them in place). "
                        "Tie weights inside the model (one parameter used twice), copy one of "
                        "them, or pass donate=False."
                    )
                seen[id(leaf)] = where
    donated_ids = set(ids)
    for pos, arg in enumerate(batch):
        found = first_failing(arg, lambda x: isinstance(x, jax.Array) and id(x) in donated_ids)
        if found is not None:
            raise ValueError(
                f"batch argument {pos}{found[0]} is also one of the "
                f"{donated_what} arrays this step donates (overwrites in place); "
                f"{keep_a_copy}."
            )


def _concrete(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _deleted(leaf: Any) -> bool:
    return (
        isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted()
    )


_USE_RETURNED = (
    "use the arrays that step returned (e.g. params, opt_state, losses = step(params, "
    "opt_state, ...)); a step that failed while it ran consumed its donated inputs too: keep a "
    "copy, make the step with donate=False, or restore a checkpoint"
)


def check_live(tree: Any, what: str, fix: str = _USE_RETURNED) -> None:
    """Refuses arrays whose buffers were donated to an earlier call (a crash inside XLA on some
    multi-device backends); says which argument and what to do (``fix``)."""
    found = first_failing(tree, _deleted)
    if found is not None:
        raise ValueError(
            f"{what}{found[0]} was donated to an earlier call and its buffer is gone; {fix}."
        )


class ProgramCache(collections.OrderedDict):
    """Jitted programs by static configuration, at most ``size``, the least recently used
    dropped first. Each new static value (a Python number, a function given as ``method=``)
    makes a program; kept forever, a loop passing a new one per call (``scale=float(t)``, a
    lambda written in the call) grew host memory by a compiled program per call (about
    1.6 MB for a Dense layer) and slowed every call down. The first drop warns."""

    def __init__(self, size: int = 64) -> None:
        super().__init__()
        self.size = size
        self.warned = False

    def get_or_make(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        while len(self) > self.size:
            self.popitem(last=False)
            if not self.warned:
                self.warned = True
                warn_user(
                    f"an ensemble call compiled its {self.size + 1}th program, one per new "
                    "combination of Python values in its inputs (static: train=True, a number, "
                    "a function as method=) or read by its code from outside them; the least "
                    "recently used are now dropped and compiled again when needed. Pass a "
                    "number that changes between calls as an array argument (jnp.asarray(x)): "
                    "arrays are traced and compile once.",
                )
        return value


# jax 0.10.2 lowers jax.debug.print / jax.debug.callback inside a partly manual shard_map with
# ``lax.axis_index(*auto_axes)``, a TypeError as soon as two mesh axes are automatic, as a
# member's 'data' and 'model' always are. Users put such prints in models to debug them, and
# the bare error names neither the print nor a way out, so the entry points say both.
_DEBUG_CALLBACK_BUG = "axis_index() takes 1 positional argument"
# A member's shard_map (only its member axis manual) runs compiled only: run op by op, under
# jax.disable_jit() or by jax_debug_nans / jax_debug_infs hunting the op that made a NaN, it
# fails in shard_map's check of its out_specs with this.
_EAGER_SHARD_MAP = "must refer to an axis marked as manual"
_PLAIN_MEMBER = "ens.model.apply(ens.member(variables, i), x) (NNX: ens.member(i)(x))"
# jax.pure_callback / io_callback inside a member: JAX compiles host callbacks only where every
# mesh axis is manual, and a member's 'data' and 'model' axes stay automatic.
_PARTLY_MANUAL_CALLBACK = "callbacks are only supported in spmd computations when all mesh axes"


@contextlib.contextmanager
def explained_errors(plain: str = _PLAIN_MEMBER) -> Iterator[None]:
    """Re-raises JAX's errors that name neither their cause nor a way out: a
    ``jax.debug.print`` / ``jax.debug.callback`` inside a member (``_DEBUG_CALLBACK_BUG``), a
    ``jax.pure_callback`` / ``io_callback`` there (``_PARTLY_MANUAL_CALLBACK``), and a member
    run op by op (``_EAGER_SHARD_MAP``); other errors pass unchanged. ``plain``: how to run one
    member's code outside the ensemble, named in the messages."""
    try:
        yield
    except NotImplementedError as e:
        if _PARTLY_MANUAL_CALLBACK not in str(e):
            raise
        raise NotImplementedError(
            "jax.pure_callback / io_callback inside an ensemble member cannot be compiled with "
            f"jax {jax.__version__}: a member runs in a shard_map manual over the member axis "
            "only (its 'data' and 'model' axes stay automatic), and JAX puts host callbacks "
            "only where every mesh axis is manual. Call it outside the member, on the stacked "
            "outputs of the ensemble call (in the same jitted step), or run one member as the "
            f"plain model: {plain}."
        ) from e
    except ValueError as e:
        if _EAGER_SHARD_MAP not in str(e):
            raise
        if jax.config.jax_debug_nans or jax.config.jax_debug_infs:
            # A FloatingPointError: what JAX's NaN check passes on as its own finding.
            raise FloatingPointError(
                "jax_debug_nans / jax_debug_infs: an ensemble call's output holds a NaN or an "
                "inf. JAX looks for the op that made it by running the call op by op, which an "
                f"ensemble member cannot do with jax {jax.__version__}; find it in the member "
                f"run as the plain model under the same flag: {plain}."
            ) from None
        raise RuntimeError(
            "ensemble calls run compiled only (each member is a shard_map over the member "
            "axis), so they do not run under jax.disable_jit(); call them outside it, or step "
            f"through one member as the plain model: {plain}."
        ) from None
    except TypeError as e:
        if _DEBUG_CALLBACK_BUG not in str(e):
            raise
        raise TypeError(
            "jax.debug.print / jax.debug.callback inside an ensemble member cannot be compiled "
            f"with jax {jax.__version__} (its lowering inside a partly manual shard_map calls "
            "lax.axis_index wrongly: the error above). To look at a value, return it (or sow "
            "it, mutable=['intermediates']) and print it outside the call, or run one member "
            f"as the plain model outside the ensemble: {plain}."
        ) from e


# ------------------------------------------------------------------------------------------------
# The member runner
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Members:
    """n members on ``mesh``: runs per-member functions with a manual member axis.

    Attributes:
      n: number of members.
      mesh: the ``('ensemble', 'data', 'model')`` mesh.
      rules: logical axis rules in force inside a member (Flax's own resolution).
      axis_name: a name bound inside each member to its data-parallel axis, for models written
        for ``pmap`` (``BatchNorm(axis_name=...)``, ``lax.pmean(x, name)``). The member is one
        replica over its whole batch (a size-1 axis); its batch is still split over the member's
        ``'data'`` devices by the compiler, so statistics are over the member's whole batch.
      data_parallel: split the batch inputs over the member's ``'data'`` devices.
    """

    n: int
    mesh: Mesh
    rules: LogicalRules
    axis_name: str | None = None
    data_parallel: bool = True

    def __post_init__(self) -> None:
        check_rules(self.rules, self.mesh, in_members=True)

    @property
    def local(self) -> int:
        """Members per device group (1 when a member spans one or more whole devices)."""
        return self.n // self.mesh.shape[MEMBER_AXIS]

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Flax's logical rules, for tracing member code (the mesh comes from ``shard_map``)."""
        with nn.logical_axis_rules(self.rules):
            yield

    def split_keys(
        self, keys: Mapping[str, jax.Array], shared: frozenset[str] = frozenset()
    ) -> tuple[dict[str, jax.Array], dict[str, int | None]]:
        """Member i gets ``jax.random.split(key, n)[i]`` of every stream not in ``shared``."""
        split = {k: jax.random.split(v, self.n) if k not in shared else v for k, v in keys.items()}
        return split, {k: None if k in shared else 0 for k in keys}

    def map(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        axes: Axes,
        *,
        batched: Sequence[bool] | None = None,
        sequential: bool = False,
        squeeze: bool = False,
    ) -> Any:
        """``fn(*member_args)`` for every member; outputs stacked member-major, on the member axis.

        ``axes[j]`` is 0 when ``args[j]`` has a leading
        member axis (member i gets ``args[j][i]``), ``None`` when every member sees it whole.
        ``batched[j]`` marks inputs whose leading (per-member) axis is a batch to split over the
        member's ``'data'`` devices. ``sequential`` runs the members sharing a device one after
        another instead of vmapping them, on meshes of several devices (initialisation: a
        batched LAPACK call per CPU device next to the RNG can hang XLA's CPU runtime).
        ``squeeze``: with one member per device, run ``fn`` on the member's own slices, not
        vmapped over an axis of 1 (for gradients; see :meth:`_device_program`).
        """
        args, axes = tuple(args), tuple(axes)
        batched = tuple(batched) if batched is not None else (False,) * len(args)
        for j, (arg, ax) in enumerate(zip(args, axes)):
            if ax == 0:
                check_member_major(arg, self.n, f"per-member input {j}")
        warn_of_grouped_convs_over_data_and_model(fn, args, axes, self.mesh)
        program = self._device_program(fn, axes, batched, sequential, squeeze)
        in_specs = tuple(PartitionSpec(MEMBER_AXIS) if ax == 0 else PartitionSpec() for ax in axes)
        run = jax.shard_map(
            program,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=PartitionSpec(MEMBER_AXIS),
            axis_names={MEMBER_AXIS},
            check_vma=False,
        )
        with self.scope(), own_mesh(self.mesh), explained_errors():
            # Under jit always (inlined when already tracing one): a partially manual shard_map
            # is only supported as part of a compiled program.
            return jax.jit(run)(*args)

    def _device_program(
        self,
        fn: Callable[..., Any],
        axes: Axes,
        batched: tuple[bool, ...],
        sequential: bool,
        squeeze: bool,
    ) -> Callable[..., Any]:
        """One device's program: its ``local`` members, vmapped (or one by one).

        With one member per device, a vmap over an axis of 1 keeps donated buffers in place
        (slicing the member out and back in made XLA copy every one that the outputs
        overwrite), but it batches the gradient's dots: JAX's transpose rule for a batched
        ``dot_general`` gives a weight's gradient as ``[out, in]``, and XLA:CPU then reads it
        transposed in every optimizer fusion (a 2-member, 1024-unit MLP step: 18 ms on 2
        devices against 6 ms for the plain model). ``squeeze`` runs ``fn`` on the member's own
        slices instead: for functions whose outputs overwrite no input (gradients).
        """
        member = self._bind_axis_name(self._split_batches(fn, batched))
        local = self.local

        # A lax.map only where it matters: several members per device on a multi-device mesh.
        one_by_one = sequential and local > 1 and self.mesh.shape[MEMBER_AXIS] > 1

        def pick(args: tuple[Any, ...], j: Any) -> list[Any]:
            return [jax.tree.map(lambda x: x[j], a) if ax == 0 else a for a, ax in zip(args, axes)]

        def one_at_a_time(args: tuple[Any, ...]) -> Any:
            return jax.lax.map(lambda j: member(*pick(args, j)), jnp.arange(local))

        def program(*args: Any) -> Any:
            if one_by_one:
                return one_at_a_time(args)
            if squeeze and local == 1:
                return jax.tree.map(lambda y: jnp.expand_dims(y, 0), member(*pick(args, 0)))
            try:
                # Also with one member per device (axis size 1): XLA then keeps donated buffers
                # in place, where slicing the member out and back in made it copy them.
                return jax.vmap(member, in_axes=axes, axis_size=local)(*args)
            except NotImplementedError:
                # JAX has no batching rule for a few ops inside a partly manual program (the
                # kernel gradient of a grouped conv): run the device's members one by one.
                return one_at_a_time(args)

        return program

    def _split_batches(self, fn: Callable[..., Any], batched: tuple[bool, ...]) -> Callable:
        data = self.mesh.shape[DATA_AXIS]
        if not self.data_parallel or data == 1 or not any(batched):
            return fn

        def on_data_devices(*args: Any) -> Any:
            uneven, even = [], []

            def split(x: Any) -> Any:
                if not hasattr(x, "ndim") or x.ndim == 0 or is_key(x):
                    return x
                if x.shape[0] % data:
                    uneven.append(x.shape)
                    return x
                even.append(x.shape)
                return jax.lax.with_sharding_constraint(x, PartitionSpec(DATA_AXIS))

            args = [jax.tree.map(split, a) if b else a for a, b in zip(args, batched)]
            # Judged on rows of features ([rows, ...], more than one row) where there are any,
            # else on vectors: a member's own state passed beside its batch (BatchNorm's [5]
            # statistics, SpectralNorm's [1, 4] u, an L2 anchor's [5, 3] kernel) need not
            # split, and is no reason to warn while the batch beside it splits.
            features = lambda s: len(s) >= 2 and s[0] > 1
            if any(map(features, (*uneven, *even))):
                uneven, even = list(filter(features, uneven)), list(filter(features, even))
            # One row cannot split at all: a member's state ([1, 5]) far more often than a batch.
            rows = [] if even else [s[0] for s in uneven if s[0] > 1]
            if rows:
                warn_user(
                    f"a batch input of {max(rows)} rows does not split evenly over the "
                    f"{data} 'data' devices of a member, so each of them computes all of it: "
                    f"use a batch size that is a multiple of {data} to split the work."
                )
            return fn(*args)

        return on_data_devices

    def _bind_axis_name(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        name = self.axis_name
        if name is None:
            return fn

        def named(*args: Any) -> Any:
            out = jax.vmap(lambda: fn(*args), axis_name=name, axis_size=1)()
            return jax.tree.map(lambda y: y[0], out)

        return named


def is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
