"""Linen ensembles: n members of one ``nn.Module``, member-major variables sharded over a mesh.

Each member is the plain module run by ``jax.vmap`` over its own slice of the variables, with
``spmd_axis_name='ensemble'`` so sharding constraints inside the member keep the member axis on the
mesh's ensemble axis. Consequences a user can rely on:

- ``variables`` have exactly the plain model's tree, every leaf with a leading axis of size n.
- Member i of ``ens.apply(variables, x, rngs={'dropout': k})`` equals
  ``model.apply(ens.member(variables, i), x, rngs={'dropout': jax.random.split(k, n)[i]})``;
  the same holds for ``init`` with every rng stream (a stream named in ``shared_rngs`` is not split:
  every member gets the key itself).
- Keyword arguments to ``init``/``apply`` (``train=True``, ...) are shared by all members.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ensemble._mesh import (
    DATA_AXIS,
    MEMBER_AXIS,
    LogicalRules,
    _warn_on_unmapped_constraints,
    member_pspec,
    merge_rules,
    partitioning,
    resolve_mesh,
    take_member,
    vmap_members,
)

InAxes = int | None | Sequence[int | None]
RngLike = Any  # a key (typed or legacy), an int seed, or a dict of them per rng stream


class LinenEnsemble:
    """An n-member ensemble of a linen module, every member's variables on its own device(s).

    Build it with :func:`ensemble.build` (or directly). ``init`` places every leaf (annotated or
    not, every collection) on the member axis straight from a jitted, ``out_shardings``-constrained
    init, so no device ever holds more than its share. ``apply`` is jitted once per static
    configuration and runs under :func:`ensemble.partitioning`, so ``nn.with_logical_constraint``
    inside the model is never a silent no-op.

    Args:
      model: the plain linen module (an instance).
      n: number of members.
      mesh: a mesh from :func:`ensemble.make_mesh` (default: one is made from ``devices``).
      devices: devices for the default mesh (default: all).
      model_parallel: devices per member for tensor parallelism (needs rules onto ``'model'``).
      rules: logical axis rules, merged over :data:`ensemble.DEFAULT_RULES`.
      in_axes: ``None`` (inputs shared by all members), ``0`` (per-member inputs with a leading
        axis of size n), or one of those per positional argument.
      shared_rngs: rng streams that are *not* split per member (e.g. ``('noise',)``).
      data_parallel: when a member spans several devices on the ``'data'`` axis, split the leading
        (batch) axis of inputs over it. A hint only: results do not change.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> ens = LinenEnsemble(nn.Dense(3), n=8)
      >>> variables = ens.init(jax.random.key(0), jnp.ones((2, 5)))
      >>> variables["params"]["kernel"].shape, ens.apply(variables, jnp.ones((2, 5))).shape
      ((8, 5, 3), (8, 2, 3))
    """

    def __init__(
        self,
        model: nn.Module,
        n: int,
        *,
        mesh: Mesh | None = None,
        devices: Sequence[jax.Device] | None = None,
        model_parallel: int = 1,
        rules: Sequence[tuple[str, Any]] | None = None,
        in_axes: InAxes = None,
        shared_rngs: Sequence[str] = (),
        data_parallel: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"LinenEnsemble needs a linen nn.Module instance, got {type(model).__name__}."
            )
        mesh = resolve_mesh(n, mesh, devices, model_parallel)
        _check_in_axes(in_axes)
        if isinstance(shared_rngs, str):
            shared_rngs = (shared_rngs,)
        self._model = model
        self._n = int(n)
        self._mesh = mesh
        self._rules: LogicalRules = merge_rules(rules)
        self._in_axes = in_axes
        self._shared_rngs = frozenset(shared_rngs)
        self._data_parallel = bool(data_parallel)
        self._cache: dict[Hashable, Callable[..., Any]] = {}

    # ------------------------------------------------------------------ properties

    @property
    def n(self) -> int:
        """Number of members."""
        return self._n

    @property
    def mesh(self) -> Mesh:
        """The ``('ensemble', 'data', 'model')`` mesh the members live on."""
        return self._mesh

    @property
    def rules(self) -> LogicalRules:
        """Logical axis rules in force (user rules merged over the defaults)."""
        return self._rules

    @property
    def model(self) -> nn.Module:
        """The plain (single-member) module; ``model.apply(ens.member(v, i), x)`` runs member i."""
        return self._model

    @property
    def in_axes(self) -> InAxes:
        """``None``: shared inputs; ``0``: per-member inputs (or one of those per argument)."""
        return self._in_axes

    def __repr__(self) -> str:
        return (
            f"LinenEnsemble({type(self._model).__name__}, n={self._n}, "
            f"mesh={dict(self._mesh.shape)}, in_axes={self._in_axes})"
        )

    # ------------------------------------------------------------------ init

    def init(self, rng: RngLike, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Initialises all members straight into their shards; returns unboxed variables.

        Args:
          rng: a key (``jax.random.key`` or legacy ``PRNGKey``; used for ``'params'``), an int
            seed, or a dict ``{'params': key, 'dropout': key, ...}``. Each stream is split into n
            keys, member i gets ``jax.random.split(key, n)[i]`` (unless in ``shared_rngs``).
          *args: sample inputs, as for ``model.init`` (per-member if ``in_axes=0``).
          **kwargs: keyword arguments of the module's ``__call__``, shared by all members.

        Returns:
          ``{'params': ..., <other collections>: ...}``, every leaf ``[n, ...]`` and sharded on
          the member axis (and further mesh axes through logical annotations and rules).
        """
        jitted, _ = self._init_program(rng, args, kwargs)
        rngs = _normalize_rngs(rng, default="params")
        dynamic, _ = _split_kwargs(kwargs)
        with traced_partitioning(self._mesh, self._rules):
            return jitted(rngs, args, dynamic)

    def init_shardings(self, rng: RngLike, *args: Any, **kwargs: Any) -> Any:
        """The ``NamedSharding`` of every leaf that :meth:`init` returns (nothing is computed).

        Useful to restore a checkpoint straight into shards.
        """
        return self._init_program(rng, args, kwargs)[1]

    def lower_init(self, rng: RngLike, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The lowered init program, e.g. ``ens.lower_init(k, x).compile().memory_analysis()``
        to see that each device only ever holds its share."""
        jitted, _ = self._init_program(rng, args, kwargs)
        rngs = _normalize_rngs(rng, default="params")
        dynamic, _ = _split_kwargs(kwargs)
        with traced_partitioning(self._mesh, self._rules):
            return jitted.lower(rngs, args, dynamic)

    def _init_program(
        self, rng: RngLike, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Callable[..., Any], Any]:
        rngs = _normalize_rngs(rng, default="params")
        self._check_args(args)
        dynamic, static = _split_kwargs(kwargs)
        signature = _abstract_signature((rngs, args, dynamic))
        key = ("init", static, signature)
        if key in self._cache:
            return self._cache[key]

        model, n = self._model, self._n
        split = self._split_rngs(rngs)
        static_kw = dict(static)

        def boxed_init(rngs, args, dynamic, unbox):
            member_rngs = {k: jax.random.split(v, n) if split[k] else v for k, v in rngs.items()}
            rng_axes = {k: 0 if split[k] else None for k in rngs}

            def one(r, *a):
                out = model.init(r, *a, **dynamic, **static_kw)
                # Unboxing inside the member applies the annotation's constraint at the member's
                # own rank; the vmap's spmd_axis_name adds the member axis to it.
                return _unbox(out) if unbox else out

            args = self._constrain_inputs(args)
            in_axes = (rng_axes, *self._arg_axes(len(args)))
            # Not a plain vmap: members sharing a device are initialised one after another, as a
            # batched LAPACK call per device (orthogonal init's QR) can hang on CPU devices.
            return vmap_members(one, n, self._mesh, in_axes)(member_rngs, *args)

        with traced_partitioning(self._mesh, self._rules):
            boxed = jax.eval_shape(lambda r, a, d: boxed_init(r, a, d, False), rngs, args, dynamic)
        shardings = jax.tree_util.tree_map(
            lambda leaf: self._leaf_sharding(leaf), boxed, is_leaf=_is_box
        )
        jitted = jax.jit(lambda r, a, d: boxed_init(r, a, d, True), out_shardings=shardings)
        self._cache[key] = (jitted, shardings)
        return jitted, shardings

    def _leaf_sharding(self, leaf: Any) -> NamedSharding:
        if isinstance(leaf, nn.LogicallyPartitioned):
            ndim = len(leaf.value.shape)
            return NamedSharding(self._mesh, member_pspec(ndim, leaf.names, self._rules))
        if isinstance(leaf, meta.Partitioned):  # names are mesh axes already
            ndim = len(leaf.value.shape)
            names = list(leaf.names)
            if len(names) == ndim:
                names = names[1:]
            if len(names) != ndim - 1:
                names = [None] * (ndim - 1)
            return NamedSharding(self._mesh, PartitionSpec(MEMBER_AXIS, *names))
        if isinstance(leaf, meta.AxisMetadata):
            leaf = leaf.unbox(apply_constraint=False) if hasattr(leaf, "unbox") else leaf
        return NamedSharding(self._mesh, member_pspec(len(leaf.shape), None, self._rules))

    # ------------------------------------------------------------------ apply

    def apply(
        self,
        variables: Mapping[str, Any],
        *args: Any,
        rngs: Mapping[str, Any] | None = None,
        mutable: bool | str | Sequence[str] = False,
        method: str | Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Runs every member; outputs carry a leading member axis of size n.

        Args:
          variables: ensemble variables (from :meth:`init`), every leaf ``[n, ...]``.
          *args: inputs, shared (``in_axes=None``) or per-member with leading axis n.
          rngs: ``{'dropout': key, ...}``; each stream is split per member like in :meth:`init`.
          mutable: collections to update, as in ``model.apply`` (e.g. ``['batch_stats']``);
            then ``(outputs, updates)`` is returned, the updates member-major too.
          method: a method name or function of the module to run instead of ``__call__``.
          **kwargs: keyword arguments of the method (``train=True``), shared by all members.
            Python values are static (a new value compiles once); arrays are traced.
        """
        self._check_variables(variables)
        self._check_args(args)
        if rngs is not None and not isinstance(rngs, Mapping):
            raise TypeError(
                "rngs= must be a dict of keys per stream, e.g. {'dropout': jax.random.key(0)}; "
                f"got {type(rngs).__name__}."
            )
        rngs = _normalize_rngs(rngs, default=None) if rngs else {}
        if isinstance(mutable, list | tuple):
            mutable = tuple(mutable)
        dynamic, static = _split_kwargs(kwargs)
        key = ("apply", static, mutable, method, tuple(sorted(rngs)))
        jitted = self._cache.get(key)
        if jitted is None:
            jitted = self._cache[key] = self._make_apply(static, mutable, method, tuple(rngs))
        with traced_partitioning(self._mesh, self._rules):
            return jitted(variables, rngs, args, dynamic)

    def _make_apply(self, static, mutable, method, stream_names) -> Callable[..., Any]:
        model, n = self._model, self._n
        split = self._split_rngs(dict.fromkeys(stream_names))
        static_kw = dict(static)

        def apply_fn(variables, rngs, args, dynamic):
            member_rngs = {k: jax.random.split(v, n) if split[k] else v for k, v in rngs.items()}
            rng_axes = {k: 0 if split[k] else None for k in rngs}

            def one(v, r, *a):
                return model.apply(
                    v, *a, rngs=r or None, mutable=mutable, method=method, **dynamic, **static_kw
                )

            args = self._constrain_inputs(args)
            in_axes = (0, rng_axes, *self._arg_axes(len(args)))
            out = jax.vmap(one, in_axes=in_axes, axis_size=n, spmd_axis_name=MEMBER_AXIS)(
                variables, member_rngs, *args
            )
            return jax.tree_util.tree_map(self._constrain_member_major, out)

        return jax.jit(apply_fn)

    def _constrain_member_major(self, x: Any) -> Any:
        return constrain_member_major(x, self._mesh)

    def _constrain_inputs(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        axes = self._arg_axes(len(args))
        return constrain_inputs(args, axes, self._mesh, self._data_parallel)

    # ------------------------------------------------------------------ members

    def member(self, variables: Mapping[str, Any], i: int) -> dict[str, Any]:
        """Member i's variables as plain variables: ``ens.model.apply(ens.member(v, i), x)``.

        The arrays stay on the device(s) that already held member i (assembled from its shards:
        no gather, no copy to the other devices); move them with ``jax.device_put`` if needed.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn
          >>> ens = LinenEnsemble(nn.Dense(3), n=8)
          >>> v = ens.init(jax.random.key(0), jnp.ones((1, 5)))
          >>> ens.model.apply(ens.member(v, 2), jnp.ones((1, 5))).shape
          (1, 3)
        """
        self._check_variables(variables)
        if not isinstance(i, int | np.integer) or not -self._n <= i < self._n:
            raise IndexError(f"member index {i!r} out of range for n={self._n} members.")
        return jax.tree_util.tree_map(
            lambda a: take_member(a, int(i), self._mesh, self._n), dict(variables)
        )

    # ------------------------------------------------------------------ checks

    def _split_rngs(self, rngs: Mapping[str, Any]) -> dict[str, bool]:
        return {k: k not in self._shared_rngs for k in rngs}

    def _arg_axes(self, count: int) -> tuple[int | None, ...]:
        if self._in_axes is None or isinstance(self._in_axes, int):
            return (self._in_axes,) * count
        axes = tuple(self._in_axes)
        if len(axes) != count:
            raise ValueError(
                f"in_axes={axes} gives one axis per positional input, but {count} input(s) were "
                "passed."
            )
        return axes

    def _check_args(self, args: tuple[Any, ...]) -> None:
        for pos, (arg, ax) in enumerate(zip(args, self._arg_axes(len(args)))):
            if ax is None:
                continue
            for path, leaf in jax.tree_util.tree_leaves_with_path(arg):
                shape = np.shape(leaf)
                if not shape or shape[0] != self._n:
                    where = f"input {pos}{jax.tree_util.keystr(path)}"
                    raise ValueError(
                        f"{where} is per-member (in_axes=0), so its leading axis must be the "
                        f"member axis of size n={self._n}; got shape {shape}. Stack one input "
                        "per member, or build the ensemble with in_axes=None for a shared input."
                    )

    def _check_variables(self, variables: Any) -> None:
        if not isinstance(variables, Mapping):
            raise TypeError(
                f"variables must be the dict that ens.init returns, got {type(variables).__name__}."
            )
        for path, leaf in jax.tree_util.tree_leaves_with_path(dict(variables)):
            shape = np.shape(leaf)
            if not shape or shape[0] != self._n:
                raise ValueError(
                    f"variables leaf {jax.tree_util.keystr(path)} has shape {shape}, but every "
                    f"ensemble leaf needs a leading member axis of size n={self._n}. Pass the "
                    "variables from ens.init (a single member's variables go to ens.model.apply)."
                )


# ---------------------------------------------------------------------- helpers


@contextlib.contextmanager
def traced_partitioning(mesh: Mesh, rules: LogicalRules) -> Iterator[None]:
    """:func:`ensemble.partitioning`, usable inside a user's ``jax.jit`` / ``jax.grad`` too.

    ``jax.set_mesh`` refuses to run inside a trace, so there only the logical rules are set and
    flax's logical constraints get the concrete mesh passed explicitly; either way no
    ``with_logical_constraint`` in a member is a silent no-op.
    """
    with contextlib.ExitStack() as stack:
        # Innermost patch first, so the unmapped-name warning still points at the user's model.
        stack.enter_context(_constraints_on(mesh))
        try:
            stack.enter_context(partitioning(mesh, rules))
        except ValueError as e:
            if "set_mesh" not in str(e):
                raise
            stack.enter_context(nn.logical_axis_rules(rules))
            stack.enter_context(_warn_on_unmapped_constraints(rules))
        yield


@contextlib.contextmanager
def _constraints_on(default_mesh: Mesh) -> Iterator[None]:
    """Makes flax's ``with_logical_constraint`` default to ``default_mesh`` (needs no mesh set)."""
    from flax.linen import spmd

    current = spmd.with_logical_constraint

    def on_mesh(x, logical_axis_resources, rules=None, mesh=None, **kwargs):
        mesh = default_mesh if mesh is None else mesh
        return current(x, logical_axis_resources, rules=rules, mesh=mesh, **kwargs)

    previous = (spmd.with_logical_constraint, nn.with_logical_constraint)
    spmd.with_logical_constraint = nn.with_logical_constraint = on_mesh
    try:
        yield
    finally:
        spmd.with_logical_constraint, nn.with_logical_constraint = previous


def constrain_inputs(
    args: tuple[Any, ...], axes: Sequence[int | None], mesh: Mesh, data_parallel: bool = True
) -> tuple[Any, ...]:
    """Sharding hints for inputs inside a jitted ensemble program.

    Per-member inputs (axis 0) keep their member axis on the mesh's member axis. When a member spans
    several devices on ``'data'``, the next (batch) axis is split over it if it divides evenly.
    Every other axis is left to the compiler, so this never changes results.
    """
    data = mesh.shape.get(DATA_AXIS, 1)
    out = []
    for arg, ax in zip(args, axes):

        def place(x, ax=ax):
            if not hasattr(x, "ndim") or x.ndim == 0 or _is_key(x):
                return x
            lead = [MEMBER_AXIS] if ax == 0 else []
            rest = x.ndim - len(lead)
            if data_parallel and data > 1 and rest and x.shape[len(lead)] % data == 0:
                lead.append(DATA_AXIS)
            if not lead:
                return x
            spec = [*lead] + [PartitionSpec.UNCONSTRAINED] * (x.ndim - len(lead))
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))

        out.append(jax.tree_util.tree_map(place, arg))
    return tuple(out)


def constrain_member_major(x: Any, mesh: Mesh) -> Any:
    """Keeps a member-major array's axis 0 on the member axis; the rest is left to the compiler."""
    if not hasattr(x, "ndim") or x.ndim == 0:
        return x
    spec = PartitionSpec(MEMBER_AXIS, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _check_in_axes(in_axes: Any) -> None:
    ok = lambda a: a is None or (isinstance(a, int) and not isinstance(a, bool) and a == 0)
    if ok(in_axes):
        return
    if isinstance(in_axes, list | tuple) and all(ok(a) for a in in_axes):
        return
    raise ValueError(
        f"in_axes must be None (shared inputs), 0 (per-member inputs, leading axis n) or a "
        f"tuple of those per positional input; got {in_axes!r}."
    )


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def _unbox(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: x.unbox() if isinstance(x, meta.AxisMetadata) else x, tree, is_leaf=_is_box
    )


def _normalize_rngs(rng: RngLike, default: str | None) -> dict[str, jax.Array]:
    """A key, seed or dict of them -> ``{stream: key}`` with int seeds turned into typed keys."""

    def as_key(name: str, value: Any) -> jax.Array:
        if isinstance(value, int | np.integer) and not isinstance(value, bool):
            return jax.random.key(int(value))
        if isinstance(value, jax.Array | np.ndarray):
            if jnp.issubdtype(value.dtype, jax.dtypes.prng_key) and value.shape == ():
                return value
            if value.dtype == jnp.uint32 and value.shape == (2,):  # legacy PRNGKey
                return jnp.asarray(value)
        raise TypeError(
            f"rng stream {name!r} must be one key (jax.random.key(0) or jax.random.PRNGKey(0)) "
            f"or an int seed; got {type(value).__name__} {getattr(value, 'shape', '')}."
        )

    if isinstance(rng, Mapping):
        return {str(k): as_key(str(k), v) for k, v in rng.items()}
    if default is None:
        raise TypeError("rngs= must be a dict like {'dropout': key}.")
    return {default: as_key(default, rng)}


def _split_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, Any], ...]]:
    """Arrays are traced; Python values (``train=True``) are static and part of the cache key."""
    dynamic, static = {}, []
    for k, v in kwargs.items():
        leaves = jax.tree_util.tree_leaves(v)
        if leaves and all(isinstance(x, jax.Array | np.ndarray) for x in leaves):
            dynamic[k] = v
            continue
        try:
            hash(v)
        except TypeError:
            raise TypeError(
                f"keyword argument {k}={v!r} is neither an array (traced) nor hashable (static); "
                "pass arrays, or hashable Python values such as bools and tuples."
            ) from None
        static.append((k, v))
    return dynamic, tuple(sorted(static, key=lambda kv: kv[0]))


def _abstract_signature(tree: Any) -> Hashable:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)
