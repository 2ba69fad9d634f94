"""Chex-style assertions that an ensemble's state really sits where it claims to.

Metadata is not placement: a variable annotated ``('ensemble', ...)`` can still be replicated on
every device (NNX's transform metadata alone does exactly that). These checks read
``addressable_shards`` (``shard.index`` and ``shard.device``) of the actual arrays: the device
each shard really lives on, and which members' rows it holds by the array's own index (the
checks do not compare content: rows of the right shape holding another member's numbers, which
only a hand-assembled array can have, pass).

All three raise ``AssertionError`` (prefixed ``[Chex]``), accept chex's auxiliary keyword arguments
(``custom_message=``, ``exception_type=``, ...) and are switched off by ``chex.disable_asserts()``,
like any chex assertion. They accept any pytree: linen variables, optax states, ``nnx.State``, or an
``nnx.Module`` (its ``nnx.state`` is checked).

Example:
  >>> import jax, jax.numpy as jnp, ensemble
  >>> mesh = ensemble.make_mesh(jax.device_count())
  >>> n = jax.device_count()
  >>> params = ensemble.shard_members({"w": jnp.zeros((n, 3))}, mesh, n)
  >>> ensemble.assert_member_axis(params, n)
  >>> ensemble.assert_member_placement(params, mesh)
  >>> ensemble.assert_no_replicated_members(params, n)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ensemble._mesh import MEMBER_AXIS

_MAX_REPORTED = 8  # failures listed in one message; the rest are counted


def _chex_style(fn: Callable[..., None]) -> Callable[..., None]:
    """Gives ``fn`` chex's common behaviour (prefix, custom_message, disable_asserts)."""
    try:  # chex's own wrapper; private, so fall back to a minimal equivalent if it moves.
        from chex._src.asserts_internal import chex_assertion

        return chex_assertion(fn, jittable_assert_fn=None, name=fn.__name__)
    except (ImportError, TypeError):  # pragma: no cover - depends on the chex version
        import functools

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> None:
            try:
                from chex._src import asserts_internal

                if asserts_internal.DISABLE_ASSERTIONS:
                    return
            except ImportError:
                pass
            try:
                fn(*args, **kwargs)
            except AssertionError as e:
                raise AssertionError(f"[Chex] {fn.__name__}: {e}") from None

        return wrapped


def _leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs; an ``nnx.Module`` is read through ``nnx.state``, and an NNX Variable
    yields its array (so paths read ``['kernel']``, not ``['kernel'].value``)."""
    variable_type: tuple[type, ...] = ()
    try:
        from flax import nnx

        variable_type = (nnx.Variable,)
        if isinstance(tree, nnx.Module):
            tree = nnx.state(tree)
    except ImportError:  # pragma: no cover - flax is a dependency
        pass
    is_variable = lambda x: isinstance(x, variable_type)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_variable):
        name = jax.tree_util.keystr(path) or "<root>"
        if is_variable(leaf):
            note = _metadata_note(leaf)
            for sub, array in jax.tree_util.tree_leaves_with_path(leaf):
                # A Variable flattens to its array; keep the metadata next to the path.
                del sub
                yield name + note, array
        else:
            yield name, leaf


def _metadata_note(variable: Any) -> str:
    """The sharding an NNX Variable's metadata *claims*, to show next to where it really is."""
    try:
        meta = variable.get_metadata()
    except Exception:  # not every Variable-like object has it
        return ""
    for key in ("out_sharding", "sharding_names", "sharding"):
        if meta.get(key) is not None:
            return f" (metadata says {key}={tuple(meta[key])})"
    return ""


def _fail(problems: list[str], what: str, hint: str) -> None:
    if not problems:
        return
    shown = problems[:_MAX_REPORTED]
    more = len(problems) - len(shown)
    lines = "\n  ".join(shown)
    extra = f"\n  ... and {more} more leaves" if more > 0 else ""
    noun = "leaf" if len(problems) == 1 else "leaves"
    raise AssertionError(f"{len(problems)} {noun} {what}:\n  {lines}{extra}\n{hint}")


def _devices_str(devices: Any) -> str:
    return "{" + ", ".join(str(d) for d in sorted(devices, key=lambda d: d.id)) + "}"


def _sharding_str(leaf: Any) -> str:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return f"a host {type(leaf).__name__} (not on any device)"
    spec = getattr(sharding, "spec", None)
    where = _devices_str(sharding.device_set)
    return f"{type(sharding).__name__}({spec if spec is not None else ''}) on {where}"


def _rows_per_device(leaf: jax.Array, n: int) -> dict[Any, tuple[int, int]]:
    """Device -> [start, stop) of the member axis its shard holds (read off the real shards)."""
    rows = {}
    for shard in leaf.addressable_shards:
        start, stop, _ = shard.index[0].indices(n) if shard.index else (0, n, 1)
        rows[shard.device] = (start, stop)
    return rows


def _check_concrete(path: str, leaf: Any) -> str | None:
    if isinstance(leaf, jax.core.Tracer):
        raise TypeError(
            f"leaf {path} is a tracer: placement can only be checked on concrete arrays. Call "
            "this assertion outside jit (on the arrays a jitted function returned)."
        )
    if not isinstance(leaf, jax.Array):
        return f"{path}: {_sharding_str(leaf)}, shape {np.shape(leaf)}"
    if leaf.is_deleted():
        return f"{path}: donated to an earlier step (deleted); check the arrays it returned"
    return None


def _none_checked(tree: Any, n: int | None) -> None:
    """An assertion that skips leaves without a leading n must not pass having checked none."""
    if n is None:
        raise AssertionError("the tree has no leaves, so no member placement to check.")
    leading = sorted({np.shape(leaf)[0] for _, leaf in _leaves(tree) if np.shape(leaf)})
    scalars = any(True for _ in _leaves(tree))
    none = "none, the tree has only scalars" if scalars else "none, the tree has no arrays"
    raise AssertionError(
        f"no leaf of the tree has a leading member axis of n={n} (leading sizes: "
        f"{leading or none}), so nothing was checked; pass the "
        "number of members (not of devices) and the member-major state."
    )


@_chex_style
def assert_member_axis(tree: Any, n: int) -> None:
    """Asserts that every leaf of ``tree`` has a leading member axis of size ``n``.

    Works on arrays, tracers (inside ``jit``) and ``jax.ShapeDtypeStruct`` alike, since it only
    reads shapes. The failure lists each offending leaf's path and shape.

    Example:
      >>> import jax.numpy as jnp
      >>> assert_member_axis({"w": jnp.zeros((4, 3)), "b": jnp.zeros((4,))}, 4)
      >>> try:
      ...     assert_member_axis({"w": jnp.zeros((3,))}, 4)
      ... except AssertionError as e:
      ...     print("['w']: shape (3,)" in str(e))
      True
    """
    problems = []
    count = 0
    for path, leaf in _leaves(tree):
        count += 1
        shape = tuple(np.shape(leaf)) if not hasattr(leaf, "shape") else tuple(leaf.shape)
        if not shape or shape[0] != n:
            problems.append(f"{path}: shape {shape}")
    if count == 0:
        raise AssertionError("the tree has no leaves, so no member axis to check.")
    _fail(
        problems,
        f"without a leading member axis of size n={n}",
        "Every member-major leaf needs shape (n, ...). Build state with ensemble.build, or add "
        "the axis (e.g. jnp.broadcast_to(x, (n, *x.shape))) and place it with "
        "ensemble.shard_members.",
    )


@_chex_style
def assert_member_placement(tree: Any, mesh: Mesh, n: int | None = None) -> None:
    """Asserts that each member's slice of every member-major leaf sits on its own device(s).

    The mesh's ``'ensemble'`` axis of size E splits the n members into E contiguous blocks:
    member ``i`` belongs to block ``e = i // (n // E)``, and must live on exactly the devices of
    ``mesh.devices`` at ensemble index ``e`` (one device when there is one member or several
    members per device; all ``D / n`` devices of the member when a member spans several). This
    is checked on ``addressable_shards``: for every shard, the member rows ``shard.index[0]``
    and the ``shard.device`` that really holds them.

    Args:
      tree: any pytree of ``jax.Array`` (or an ``nnx.Module``).
      mesh: the ensemble's mesh (``ensemble.make_mesh`` or the one given to ``build``).
      n: number of members. If given, only leaves with leading axis ``n`` are checked (others,
        like a shared step counter, are skipped; a tree with no such leaf fails); if ``None``,
        every leaf must be member-major and ``n`` is read from the leaves.

    Example:
      >>> import jax, jax.numpy as jnp, ensemble
      >>> n = jax.device_count()
      >>> mesh = ensemble.make_mesh(n)
      >>> assert_member_placement(ensemble.shard_members(jnp.zeros((n, 2)), mesh, n), mesh)
    """
    if MEMBER_AXIS not in mesh.axis_names:
        raise AssertionError(
            f"mesh axes {mesh.axis_names} have no {MEMBER_AXIS!r} axis; pass the ensemble's mesh "
            "(ensemble.make_mesh(n))."
        )
    axis = mesh.axis_names.index(MEMBER_AXIS)
    blocks = mesh.devices.shape[axis]
    local = {d for d in mesh.devices.flat if d.process_index == jax.process_index()}
    block_devices = [
        {d for d in np.take(mesh.devices, e, axis=axis).flat if d in local} for e in range(blocks)
    ]
    problems, checked = [], 0
    for path, leaf in _leaves(tree):
        shape = tuple(np.shape(leaf))
        if n is not None and (not shape or shape[0] != n):
            continue  # not member-major: not this assertion's business
        checked += 1
        if not shape:
            problems.append(f"{path}: scalar, no member axis (pass n= to skip shared leaves)")
            continue
        m = shape[0]
        if m % blocks:
            problems.append(
                f"{path}: {m} members cannot be split over the mesh's {MEMBER_AXIS!r} axis of "
                f"size {blocks} (shape {shape})"
            )
            continue
        if (msg := _check_concrete(path, leaf)) is not None:
            problems.append(msg)
            continue
        per_block = m // blocks
        held: list[set] = [set() for _ in range(m)]
        for device, (start, stop) in _rows_per_device(leaf, m).items():
            for i in range(start, stop):
                held[i].add(device)
        wrong = []
        for i in range(m):
            want = block_devices[i // per_block]
            if held[i] != want:
                wrong.append(
                    f"member {i} should be on {_devices_str(want)} but lives on "
                    f"{_devices_str(held[i])}"
                )
        if wrong:
            more = f"; ... {len(wrong) - 3} more members" if len(wrong) > 3 else ""
            problems.append(
                f"{path}: shape {shape}, {_sharding_str(leaf)}: " + "; ".join(wrong[:3]) + more
            )
    if not checked:
        _none_checked(tree, n)
    _fail(
        problems,
        "not placed member by member as the mesh's 'ensemble' axis assigns",
        "Place member-major state with ensemble.build / ensemble.shard_members(tree, mesh, n), or "
        "jit with out_shardings=ensemble.member_sharding(mesh, ndim); the mesh given here must be "
        "the one the state was placed on (same device order).",
    )


def _on_one_member_block(leaf: Any) -> bool:
    """Whether the leaf's own ensemble mesh has an ``'ensemble'`` axis of size 1 (an ensemble
    built to fit on one device or one block, ``ensemble.build(..., devices=[d])``)."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or MEMBER_AXIS not in sharding.mesh.axis_names:
        return False
    return sharding.mesh.shape[MEMBER_AXIS] == 1


def _member_share(leaf: Any, n: int, mesh: Mesh | None) -> int:
    """The most member rows a device holds on ``mesh`` (or the leaf's own ensemble mesh):
    ``ceil(n / E)`` for an ``'ensemble'`` axis of size E; n where no ensemble mesh is known."""
    if mesh is None:
        sharding = getattr(leaf, "sharding", None)
        mesh = getattr(sharding, "mesh", None) if isinstance(sharding, NamedSharding) else None
    if not isinstance(mesh, Mesh) or MEMBER_AXIS not in mesh.axis_names:
        return n
    return -(-n // mesh.shape[MEMBER_AXIS])


@_chex_style
def assert_no_replicated_members(tree: Any, n: int, mesh: Mesh | None = None) -> None:
    """Asserts that no member-shaped leaf (leading axis ``n``) is held whole by one device, nor
    by more devices than its members' share of an ensemble mesh.

    Catches the two classic ways an "ensemble" silently stays on every device: NNX variables
    whose sharding metadata says ``'ensemble'`` while the arrays are replicated, and
    unannotated parameters (a default bias) that logical partitioning leaves as ``P()``; and
    members split over another mesh axis than ``'ensemble'`` (``P('data')``: each member on
    every 'data' device, twice the memory on a mesh of data 2). A leaf fails if some device
    holds all n members' rows, or more than ``ceil(n / E)`` of them on an ensemble mesh of
    ``'ensemble'`` size E (``mesh``, else the mesh the leaf's own sharding names), unless
    every device is meant to hold the whole ensemble: ``n == 1``, a single device in total, or
    a ``mesh`` whose ``'ensemble'`` axis has size 1 (without ``mesh``, leaf by leaf: the
    ensemble mesh the leaf's own sharding names, as ``ensemble.build(..., devices=[d])``
    makes; on such a mesh of several 'data' or 'model' devices each of them holds (its part
    of) every member, as that mesh asks: pass ``mesh=ensemble.make_mesh(n)`` to check against
    one member block per device). Leaves without a leading n are skipped, but a tree with no
    such leaf fails (nothing would be checked: often n given as the device count), and so does
    a donated (deleted) array.

    Example:
      >>> import jax, jax.numpy as jnp, ensemble
      >>> n = jax.device_count()
      >>> mesh = ensemble.make_mesh(n)
      >>> assert_no_replicated_members(ensemble.shard_members(jnp.zeros((n, 2)), mesh, n), n)
      >>> replicated = jax.device_put(jnp.zeros((n, 2)), jax.sharding.NamedSharding(
      ...     mesh, jax.sharding.PartitionSpec()))
      >>> try:
      ...     assert_no_replicated_members({"b": replicated}, n)
      ... except AssertionError as e:
      ...     print("['b']" in str(e) or n == 1)
      True
    """
    if n == 1:
        return
    if mesh is not None:
        if MEMBER_AXIS in mesh.axis_names and mesh.shape[MEMBER_AXIS] == 1:
            return
    elif jax.device_count() == 1:
        return
    problems, checked = [], 0
    for path, leaf in _leaves(tree):
        shape = tuple(np.shape(leaf))
        if not shape or shape[0] != n:
            continue
        checked += 1
        if (msg := _check_concrete(path, leaf)) is not None:
            problems.append(msg)
            continue
        if mesh is None and _on_one_member_block(leaf):  # its own ensemble mesh says so (a
            continue  # leaf of another ensemble in the tree does not excuse this one)
        rows = _rows_per_device(leaf, n)
        whole = [d for d, (start, stop) in rows.items() if stop - start == n]
        share = _member_share(leaf, n, mesh)
        over = [d for d, (start, stop) in rows.items() if stop - start > share]
        if whole:
            problems.append(
                f"{path}: shape {shape}, {_sharding_str(leaf)}; all {n} members held whole by "
                f"{_devices_str(whole)}"
            )
        elif over:
            problems.append(
                f"{path}: shape {shape}, {_sharding_str(leaf)}; {_devices_str(over)} hold more "
                f"than the {share} member(s) each device's block of the '{MEMBER_AXIS}' axis has"
            )
    if not checked:
        _none_checked(tree, n)
    _fail(
        problems,
        "member-shaped but not split over devices (replicated or on one device)",
        "Shard the member axis: build with ensemble.build (it shards every leaf, annotated or "
        "not), place with ensemble.shard_members(tree, mesh, n), or jit with "
        "out_shardings=ensemble.member_sharding(mesh, ndim). Sharding metadata alone (e.g. "
        "nnx.vmap's transform_metadata) does not move the arrays.",
    )
