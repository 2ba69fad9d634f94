"""Meshes, logical rules and member-axis shardings: where each member lives.

Every ensemble mesh has three axes, always in this order:

- ``'ensemble'``: the member axis. Member-major arrays (leading axis of size n) are split on it.
- ``'data'``: data parallelism inside one member (used when a member spans several devices).
- ``'model'``: tensor parallelism inside one member, reached through logical rules.

Axes of size 1 cost nothing, so the same names work for every layout. Axis types are ``Auto``
so arrays placed on the mesh work in a user's plain ``jax.jit`` without entering any context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MEMBER_AXIS = "ensemble"
DATA_AXIS = "data"
MODEL_AXIS = "model"
MESH_AXES = (MEMBER_AXIS, DATA_AXIS, MODEL_AXIS)

LogicalRules = tuple[tuple[str, Any], ...]

#: Logical name -> mesh axis: members on the member axis, a batch data-parallel inside a member.
DEFAULT_RULES: LogicalRules = ((MEMBER_AXIS, MEMBER_AXIS), ("batch", DATA_AXIS))


def layout(n: int, num_devices: int, model_parallel: int = 1) -> tuple[int, int, int]:
    """Returns the mesh shape ``(ensemble, data, model)`` for n members on ``num_devices`` devices.

    - ``n % D == 0``: ``n // D`` members per device, ensemble axis of size D.
    - ``D % n == 0``: each member spans ``D // n`` devices, split into ``data x model``.

    Example:
      >>> layout(8, 4), layout(4, 8), layout(2, 8, model_parallel=2)
      ((4, 1, 1), (4, 2, 1), (2, 2, 2))
    """
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"n (the number of members) must be a positive integer, got {n!r}.")
    if num_devices <= 0:
        raise ValueError(f"need at least one device, got {num_devices}.")
    if not isinstance(model_parallel, (int, np.integer)) or isinstance(model_parallel, bool):
        raise ValueError(
            f"model_parallel (devices per member's 'model' axis) must be a positive integer, "
            f"got {model_parallel!r}."
        )
    if model_parallel <= 0 or num_devices % model_parallel:
        raise ValueError(
            f"model_parallel={model_parallel} must be a positive divisor of the number of "
            f"devices D={num_devices}."
        )
    if n % num_devices == 0:
        if model_parallel != 1:
            raise ValueError(
                f"model_parallel={model_parallel} needs each member to span several devices, but "
                f"n={n} members on D={num_devices} devices puts {n // num_devices} member(s) on "
                "each device. Use fewer members or more devices."
            )
        return (num_devices, 1, 1)
    if num_devices % n == 0:
        per_member = num_devices // n
        if per_member % model_parallel:
            raise ValueError(
                f"each of the n={n} members spans D/n={per_member} devices, which "
                f"model_parallel={model_parallel} does not divide."
            )
        return (n, per_member // model_parallel, model_parallel)
    divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
    raise ValueError(
        f"cannot place n={n} members on D={num_devices} devices: n must be a multiple of D "
        f"(several members per device: {num_devices}, {2 * num_devices}, ...) or a divisor of D "
        f"(each member spans D/n devices: {divisors}). Pass devices=/mesh= to use a subset of "
        "the devices."
    )


def make_mesh(
    n: int,
    *,
    devices: Sequence[jax.Device] | None = None,
    model_parallel: int = 1,
) -> Mesh:
    """Builds the ``('ensemble', 'data', 'model')`` mesh for an n-member ensemble.

    Args:
      n: number of members.
      devices: devices to use (default: all of ``jax.devices()``).
      model_parallel: devices per member used for tensor parallelism (``'model'`` axis).

    Example:
      >>> mesh = make_mesh(4)
      >>> mesh.axis_names
      ('ensemble', 'data', 'model')
    """
    if isinstance(devices, jax.Device):
        devices = [devices]
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices= is empty; pass at least one device.")
    strays = [d for d in devices if not isinstance(d, jax.Device)]
    if strays:
        raise TypeError(
            f"devices= must list jax.Device objects, got {strays[0]!r}; pass e.g. "
            "jax.devices()[:4] (not indices or names)."
        )
    if len(set(devices)) != len(devices):
        repeated = sorted({str(d) for d in devices if devices.count(d) > 1})
        raise ValueError(
            f"devices= lists {repeated} more than once; each device can hold one place in the "
            "mesh. Pass distinct devices (e.g. jax.devices()[:k])."
        )
    shape = layout(n, len(devices), model_parallel)
    return Mesh(
        np.asarray(devices, dtype=object).reshape(shape),
        MESH_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
    )


def member_index(i: Any, n: int) -> int:
    """``i`` checked as an index of one of n members (negative counts from the end)."""
    if not isinstance(i, int | np.integer) or isinstance(i, bool):
        raise TypeError(f"member index must be an int, got {i!r} ({type(i).__name__}).")
    if not -n <= i < n:
        raise IndexError(
            f"member index {i} out of range for n={n} members: use one in [0, {n}) (or "
            "negative, counting from the end)."
        )
    return int(i)


def check_mesh(mesh: Mesh, n: int) -> Mesh:
    """Validates a user-given mesh for n members; returns it unchanged."""
    layout(n, 1)  # n must be a positive integer
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh= must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if MEMBER_AXIS not in mesh.axis_names:
        raise ValueError(
            f"mesh axes {mesh.axis_names} have no {MEMBER_AXIS!r} axis to put members on; "
            "build one with ensemble.make_mesh(n)."
        )
    missing = [a for a in MESH_AXES if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"mesh axes {mesh.axis_names} lack {missing}: an ensemble mesh has the axes "
            f"{MESH_AXES} (size 1 where unused); build one with ensemble.make_mesh(n), or "
            f"Mesh(devices.reshape(-1, 1, 1), {MESH_AXES})."
        )
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    other = {
        a: str(types[a]).split(".")[-1] for a in MESH_AXES if types[a] != jax.sharding.AxisType.Auto
    }
    if other:  # members are placed and constrained by sharding specs, which need Auto axes
        raise ValueError(
            f"mesh axes {other} are not Auto: an ensemble mesh's axes are Auto (jax.make_mesh "
            "makes Explicit ones by default); pass axis_types=(jax.sharding.AxisType.Auto,) * "
            f"{len(mesh.axis_names)} to jax.make_mesh, or build it with ensemble.make_mesh(n)."
        )
    size = mesh.shape[MEMBER_AXIS]
    if n % size:
        raise ValueError(
            f"n={n} members cannot be split over the mesh's {MEMBER_AXIS!r} axis of size {size}: "
            "n must be a multiple of it."
        )
    return mesh


def resolve_mesh(
    n: int,
    mesh: Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    model_parallel: int = 1,
) -> Mesh:
    """The ensemble's mesh: ``mesh`` validated for n members, or one made from ``devices``."""
    if mesh is None:
        return make_mesh(n, devices=devices, model_parallel=model_parallel)
    if devices is not None or model_parallel != 1:
        raise ValueError(
            "mesh= fixes the devices and the model-parallel split; pass mesh= alone, or "
            "devices=/model_parallel= without it."
        )
    layout(n, 1)  # n must be a positive integer
    return check_mesh(mesh, n)


def merge_rules(rules: Sequence[tuple[str, Any]] | None) -> LogicalRules:
    """User rules first (they win), then the defaults for names the user did not map."""
    bad = isinstance(rules, str) or not all(
        isinstance(r, tuple | list) and len(r) == 2 for r in (rules or ())
    )
    if bad:
        raise ValueError(
            f"rules must be (logical name, mesh axis or None) pairs, e.g. [('hidden', 'model'), "
            f"('embed', None)]; got {rules!r}."
        )
    rules = tuple((str(k), v) for k, v in (rules or ()))
    names = {k for k, _ in rules}
    return rules + tuple(r for r in DEFAULT_RULES if r[0] not in names)


def member_pspec(
    ndim: int, logical: Sequence[str | None] | None = None, rules: LogicalRules = DEFAULT_RULES
) -> PartitionSpec:
    """PartitionSpec for a member-major array: axis 0 on the member axis, the rest by rules.

    ``logical`` are the logical names of the member's own array (from
    ``nn.with_logical_partitioning`` / ``nnx.with_partitioning``), with or without a leading
    ``'ensemble'``. They resolve through Flax's ``logical_to_mesh_axes`` exactly as for the plain
    model: names cover the leading axes, any axes after them are not split (so an annotation with
    fewer names than the array has axes keeps the split Flax gives it). Unannotated leaves
    (``logical=None``) still get their member axis split.

    Example:
      >>> member_pspec(3)  # unannotated: only the member axis is split
      P('ensemble', None, None)
      >>> member_pspec(3, ("batch", None))  # DEFAULT_RULES put 'batch' on the data axis
      P('ensemble', 'data', None)
    """
    if ndim == 0:
        raise ValueError("a member-major array needs a leading member axis; got a scalar.")
    names = list(logical) if logical is not None else []
    if names[:1] == [MEMBER_AXIS]:
        names = names[1:]
    if len(names) > ndim - 1:
        raise ValueError(
            f"logical names {tuple(names)} have more entries than the member's array has axes "
            f"({ndim - 1})."
        )
    inner = tuple(nn.logical_to_mesh_axes(tuple(names), rules)) if names else ()
    return PartitionSpec(MEMBER_AXIS, *inner, *([None] * (ndim - 1 - len(inner))))


def unmapped_names(names: Sequence[Sequence[Any] | None], rules: LogicalRules) -> list[str]:
    """Logical names used in ``names`` (one tuple per array) that no rule maps."""
    mapped = {k for k, _ in rules}
    found = {
        name
        for spec in names
        for name in (spec or ())
        if isinstance(name, str) and name not in mapped
    }
    return sorted(found)


def check_split(
    path: Any,
    shape: Sequence[int],
    spec: PartitionSpec,
    mesh: Mesh,
    unsplit: str = "map its logical name to None in rules=",
) -> None:
    """Refuses, naming the leaf, a member-major leaf split where it cannot be: a dimension its
    mesh axes do not divide (JAX's IndivisibleError named neither the parameter nor what to
    change), or a dimension inside a member on the member axis (a DuplicateSpecError).
    ``unsplit``: how to leave a dimension whole, for the kind of annotation it has."""
    where = f"{jax.tree_util.keystr(tuple(path))} of shape {tuple(shape[1:])} per member"
    for axis, entry in enumerate(spec):
        if entry is None or axis == 0 or axis >= len(shape):  # (axis 0: the members, by layout)
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        if MEMBER_AXIS in names:
            raise ValueError(
                f"{where}: its axis {axis - 1} is split over {MEMBER_AXIS!r}, the axis the "
                f"members are already split over; use 'data' or 'model' there, or "
                f"{unsplit.replace('map its logical name', 'map that name')}."
            )
        ways = int(np.prod([mesh.shape[a] for a in names]))
        if shape[axis] % ways:
            raise ValueError(
                f"{where}: its axis {axis - 1} ({shape[axis]}) is split over mesh axis "
                f"{'/'.join(map(str, names))} ({ways} devices), which does not divide it; make "
                f"it a multiple of {ways}, or {unsplit}."
            )


def member_sharding(
    mesh: Mesh,
    ndim: int,
    logical: Sequence[str | None] | None = None,
    rules: LogicalRules = DEFAULT_RULES,
) -> NamedSharding:
    """NamedSharding of a member-major array of rank ``ndim`` on ``mesh``.

    Example:
      >>> sharding = member_sharding(make_mesh(8), 2)
      >>> sharding.shard_shape((8, 3))  # one member's row per device
      (1, 3)
    """
    return NamedSharding(mesh, member_pspec(ndim, logical, rules))


def kept_sharding(
    x: Any,
    mesh: Mesh,
    n: int,
    rules: LogicalRules = DEFAULT_RULES,
    placed: Callable[[], NamedSharding] | None = None,
) -> NamedSharding:
    """Where a train step keeps a state array ``x`` (its output's sharding): where it is when it
    is on ``mesh`` and split on the member axis (split on 'model' too, say) or not member-major
    (an optimizer's step count); anything else goes where ``placed()`` says (the model's own
    placement of it), by default on the member axis (host arrays, and arrays whose members are
    not split: a replicated copy would stay on every device, n times the memory, step after
    step), or is replicated when it is not member-major."""
    sharding = getattr(x, "sharding", None)
    shape = np.shape(x)
    member_major = len(shape) >= 1 and shape[0] == n
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        first = sharding.spec[0] if len(sharding.spec) else None
        names = first if isinstance(first, tuple) else (first,)
        if MEMBER_AXIS in names or mesh.shape[MEMBER_AXIS] == 1 or not member_major:
            return sharding
    if placed is not None:
        return placed()
    if not member_major:
        return NamedSharding(mesh, PartitionSpec())
    return member_sharding(mesh, len(shape), None, rules)


def shard_members(tree: Any, mesh: Mesh, n: int, rules: LogicalRules = DEFAULT_RULES) -> Any:
    """Places every leaf with leading axis n on the member axis; other leaves are replicated.

    Use it for trees built outside ``ensemble`` (per-member batches, hyperparameters, metrics
    that came back to the host). A leaf already split on this mesh's member axis keeps its
    placement (a tensor-parallel split inside members too) and is not copied. A boxed array
    (``nn.LogicallyPartitioned``, as a model's own init returns it) is also split inside
    members by its logical names through ``rules``.

    Example:
      >>> import numpy as np
      >>> tree = {"x": np.ones((8, 3)), "lr": np.float32(0.1)}
      >>> placed = shard_members(tree, make_mesh(8), n=8)
      >>> placed["x"].sharding.spec, placed["lr"].sharding.spec  # split / replicated
      (P('ensemble', None), P())
    """

    def place(x, names=None):
        if isinstance(x, nn.LogicallyPartitioned):
            return x.replace_boxed(place(x.unbox(apply_constraint=False), x.names))
        shape = np.shape(x)
        if len(shape) >= 1 and shape[0] == n:
            if names is None and _on_member_axis(x, mesh):
                return x
            target = member_sharding(mesh, len(shape), names, rules)
        else:
            target = NamedSharding(mesh, PartitionSpec())
        return jax.device_put(x, target)

    check_mesh(mesh, n)
    boxed = lambda x: isinstance(x, nn.LogicallyPartitioned)
    return jax.tree_util.tree_map(place, tree, is_leaf=boxed)


@contextlib.contextmanager
def partitioning(mesh: Mesh, rules: Sequence[tuple[str, Any]] | None = None) -> Iterator[Mesh]:
    """Sets the JAX mesh and the Flax logical axis rules (linen and NNX) together.

    Inside it, ``nn.with_logical_constraint`` / NNX sharding annotations in your own code resolve
    against ``rules`` (merged over :data:`DEFAULT_RULES`) on ``mesh``, so no constraint is a silent
    no-op. Ensemble calls do not need it: they set the rules for the members themselves.

    Example:
      >>> mesh = make_mesh(4)
      >>> with partitioning(mesh, [("hidden", "model")]):
      ...     pass
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"partitioning needs a jax.sharding.Mesh (e.g. ens.mesh); got {mesh!r}.")
    merged = merge_rules(rules)
    check_rules(merged, mesh)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(jax.set_mesh(mesh))
        except ValueError as e:  # JAX's "`set_mesh` can only be used outside of `jax.jit`"
            if "outside of" not in str(e):
                raise
            raise ValueError(_UNDER_TRACE) from None
        stack.enter_context(nn.logical_axis_rules(merged))
        yield mesh


_UNDER_TRACE = (
    "ensemble: partitioning(...), and making an NNX ensemble or its optimizer (ensemble.build, "
    "nnx_optimizer, step.init()), cannot run inside a traced function (jax.jit, "
    "jax.eval_shape, nnx.eval_shape), since they set the mesh: call them outside. For a "
    "checkpoint's restore target, make the ensemble or optimizer itself (its state is made "
    "straight into each device's share) and restore into it: nnx.update(x, "
    "ensemble.distributed.restore_checkpoint(path, nnx.state(x)))."
)


@contextlib.contextmanager
def own_mesh(mesh: Mesh) -> Iterator[None]:
    """The ensemble's own mesh in context while its code runs, where the caller set another
    (its own ``jax.set_mesh``, another ensemble's :func:`partitioning`): JAX refuses a
    ``shard_map`` or an array of one mesh under another mesh in context. No mesh set: no change.
    """
    current = jax.sharding.get_abstract_mesh()
    if current.empty or _in_context(mesh):
        yield
        return
    try:
        ctx: Any = jax.set_mesh(mesh)
    except ValueError:  # tracing the caller's jit: the concrete mesh cannot change there
        if current.size != mesh.size:  # (JAX: "use_abstract_mesh cannot change the size")
            raise ValueError(
                f"this ensemble's mesh ({mesh.size} devices) cannot run inside a jit (or "
                f"another JAX transformation) traced under a mesh of {current.size} devices: "
                "JAX cannot switch to a mesh of another size there; call the ensemble "
                "outside that mesh's context, or transform it on its own."
            ) from None
        ctx = jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
    with ctx:
        yield


@contextlib.contextmanager
def no_mesh_set() -> Iterator[None]:
    """No caller's mesh in context, where one can be unset (not while a jit traces): arrays
    made meanwhile are placed by no mesh of the caller's, and programs run as if called
    outside one."""
    if jax.sharding.get_abstract_mesh().empty:
        yield
        return
    with _mesh_unset_or(contextlib.nullcontext()):
        yield


@contextlib.contextmanager
def as_if_outside_meshes(mesh: Mesh) -> Iterator[None]:
    """For an entry that jits the call itself: no caller's mesh in context while it runs, as
    if called outside one (its member program then enters ``mesh`` itself). Under a caller's
    mesh of another shape, device order or devices, that jit's trace could not switch to
    ``mesh`` (``use_abstract_mesh`` keeps the size; the partitioner aborted on a manual
    sub-axis; JAX refused the devices), and entering ``mesh`` instead refused inputs made
    under the caller's (typed with its axes). Inside a caller's jit: :func:`own_mesh`."""
    if jax.sharding.get_abstract_mesh().empty or _in_context(mesh):
        yield
        return
    with _mesh_unset_or(own_mesh(mesh)):
        yield


def _mesh_unset_or(inside_a_jit: Any) -> Any:
    """A context with no mesh set (``jax.set_mesh(None)`` unsets it at once, restored on
    exit); while a jit traces, where none can be set, ``inside_a_jit``."""
    try:
        return jax.set_mesh(None)
    except ValueError:  # tracing the caller's jit
        return inside_a_jit


def _in_context(mesh: Mesh) -> bool:
    """Whether ``mesh`` is the one in context: its axes, and its devices in their order where
    that can be told (outside a jit; a mesh of the same axes on other devices is another)."""
    if jax.sharding.get_abstract_mesh() != mesh.abstract_mesh:
        return False
    try:
        concrete = jax.sharding.get_mesh()
    except ValueError:  # tracing a jit: only the abstract mesh is known
        return True
    return concrete.empty or concrete == mesh


def check_rules(rules: LogicalRules, mesh: Mesh, in_members: bool = False) -> None:
    """Refuses rules onto axes ``mesh`` lacks; ``in_members``: also rules that split a member's
    own dimension over the member axis (it holds the members: each device has its members
    whole). Outside members, your own code may put a member-major array's names on it."""
    unknown = [v for _, v in rules if v is not None and not _axes_in_mesh(v, mesh)]
    if unknown:
        raise ValueError(
            f"rules map logical names onto mesh axes {unknown} that mesh {mesh.axis_names} lacks."
        )
    onto_members = [k for k, v in rules if k != MEMBER_AXIS and MEMBER_AXIS in _axes(v)]
    if in_members and onto_members:
        raise ValueError(
            f"rules map logical names {onto_members} onto the {MEMBER_AXIS!r} axis, which holds "
            f"the members; a dimension inside a member can go on {DATA_AXIS!r} or "
            f"{MODEL_AXIS!r} (or None: not split)."
        )


def _axes(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _axes_in_mesh(value: Any, mesh: Mesh) -> bool:
    return all(a in mesh.axis_names for a in _axes(value))


def devices_per_member(mesh: Mesh) -> int:
    """How many devices each member's arrays span: every device of its member-axis slice (the
    members sharing that slice each span all of it)."""
    return mesh.devices.size // mesh.shape[MEMBER_AXIS]


def take_member(tree: Any, i: int, mesh: Mesh, n: int) -> Any:
    """Row ``i`` of every member-major array of ``tree``, assembled from the shards that
    already hold it.

    Plain ``x[i]`` would broadcast the row to every device of the mesh (n times the memory for a
    member that barely fits on its own devices). Here each device that holds member ``i`` keeps
    its piece, and the result lives on a mesh of just those devices (the mesh minus its member
    axis, e.g. ``('data', 'model')``). Arrays not split on ``mesh``'s member axis fall back to
    ``x[i]``. Each device cuts all its pieces in one jitted call: one small compile per device
    and tree, where a slice per array compiled once per array and device.
    """
    i = int(i) % n
    leaves, treedef = jax.tree.flatten(tree)
    split = [k for k, x in enumerate(leaves) if _on_member_axis(x, mesh)]
    out = [x if _on_member_axis(x, mesh) else x[i] for x in leaves]
    if not split:
        return jax.tree.unflatten(treedef, out)
    try:
        one_device = jax.set_mesh(None)
    except ValueError:  # under a trace (a jit or vmap closing over the arrays): in its program
        return jax.tree.unflatten(treedef, [x[i] for x in leaves])
    axis = mesh.axis_names.index(MEMBER_AXIS)
    owner = i // (n // mesh.shape[MEMBER_AXIS])
    devices = np.take(mesh.devices, owner, axis=axis)  # e.g. the (data, model) block of member i
    names = mesh.axis_names[:axis] + mesh.axis_names[axis + 1 :]
    types = mesh.axis_types[:axis] + mesh.axis_types[axis + 1 :]
    submesh = Mesh(devices, names, axis_types=types)
    pieces: dict[int, list[jax.Array]] = {k: [] for k in split}
    with one_device:  # each cut runs on one device, whatever mesh the caller has set
        for device in [d for d in devices.flat if d.process_index == jax.process_index()]:
            shards = [_shard_on(leaves[k], device) for k in split]
            row = np.int32(i - (shards[0].index[0].start or 0))
            for k, piece in zip(split, _rows(tuple(s.data for s in shards), row)):
                pieces[k].append(piece)
    for k in split:
        spec = PartitionSpec(*tuple(leaves[k].sharding.spec)[1:])
        out[k] = jax.make_array_from_single_device_arrays(
            leaves[k].shape[1:], NamedSharding(submesh, spec), pieces[k]
        )
    return jax.tree.unflatten(treedef, out)


def _on_member_axis(x: Any, mesh: Mesh) -> bool:
    sharding = getattr(x, "sharding", None)
    return (
        isinstance(x, jax.Array)
        and isinstance(sharding, NamedSharding)
        and sharding.mesh == mesh
        and tuple(sharding.spec)[:1] == (MEMBER_AXIS,)
    )


def _shard_on(x: jax.Array, device: jax.Device) -> Any:
    return next(s for s in x.addressable_shards if s.device == device)


@jax.jit
def _rows(arrays: tuple[jax.Array, ...], row: Any) -> tuple[jax.Array, ...]:
    # The row is traced: one compile serves every member of a device.
    return tuple(jax.lax.dynamic_index_in_dim(a, row, keepdims=False) for a in arrays)
