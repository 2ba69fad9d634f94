"""Flax NNX ensembles: n members of one ``nnx.Module``, member-major and sharded over the mesh.

The ensemble is a module holding ONE member-major copy of the user's module: every Variable
(params, batch stats, rng keys and counts, anything) has a leading member axis of size n that is
split over the mesh's ``'ensemble'`` axis. Calling it vmaps the plain module over that axis.

Why the creation is jitted with ``out_shardings``: ``nnx.vmap(...,
transform_metadata={nnx.PARTITION_NAME: 'ensemble'})`` only writes ``'ensemble'`` into the
Variables' sharding *metadata*; the arrays themselves stay wherever they were computed (replicated
on every device, see FIELD-NOTES.md). Placement has to be asked for on the arrays: the creation is
traced once abstractly (``nnx.eval_shape``), every leaf gets a member-axis sharding, and the real
creation runs under ``jax.jit(..., out_shardings=...)`` so each device only ever materialises its
own members.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import spmd as nnx_spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ensemble._mesh import (
    DATA_AXIS,
    MEMBER_AXIS,
    LogicalRules,
    _warn_on_unmapped_constraints,
    member_sharding,
    merge_rules,
    partitioning,
    resolve_mesh,
    take_member,
    vmap_members,
)
from ensemble._optim import per_member

__all__ = ["NNXEnsemble", "build_nnx", "lower_build_nnx", "nnx_optimizer", "nnx_train_step"]

InAxes = int | None | tuple[int | None, ...]
RngsLike = int | jax.Array | nnx.Rngs | Mapping[str, Any]

_TRANSFORM_METADATA = {nnx.PARTITION_NAME: MEMBER_AXIS}


# ------------------------------------------------------------------------------------------------
# Partitioning scope that also works while tracing
# ------------------------------------------------------------------------------------------------


def _tracing() -> bool:
    """True inside a JAX trace (jit, vmap, grad), where ``jax.set_mesh`` is refused."""
    try:
        jax.sharding.get_mesh()
    except ValueError:
        return True
    return False


@contextlib.contextmanager
def _scope(mesh: Mesh, rules: LogicalRules) -> Iterator[None]:
    """:func:`ensemble.partitioning` where allowed; inside a trace, its abstract equivalent.

    ``jax.set_mesh`` raises inside ``jax.jit``, but NNX sharding annotations and
    ``with_logical_constraint`` only need the abstract mesh and the logical rules, which can be
    set at any trace level. Without this, constraints inside a user's ``nnx.jit`` would be silent
    no-ops.
    """
    if not _tracing():
        with partitioning(mesh, rules):
            yield
        return
    with contextlib.ExitStack() as stack:
        if jax.sharding.get_abstract_mesh() != mesh.abstract_mesh:
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        stack.enter_context(nn.logical_axis_rules(rules))
        stack.enter_context(_warn_on_unmapped_constraints(rules))
        yield


# ------------------------------------------------------------------------------------------------
# The ensemble module
# ------------------------------------------------------------------------------------------------


class NNXEnsemble(nnx.Module):
    """n members of one NNX module, stored member-major and sharded over ``mesh``'s member axis.

    Build it with :func:`ensemble.build` (or :func:`build_nnx`); the constructor only wraps a
    module whose state is already member-major and placed.

    Calling the ensemble runs every member and returns outputs with a leading axis of size n,
    sharded on the member axis. It is an ordinary ``nnx.Module``: ``nnx.jit``, ``nnx.grad``,
    ``nnx.Optimizer``, ``.train()`` / ``.eval()`` and ``nnx.state`` all work on it.

    Attributes:
      members: the member-major module (same class as the factory's output; every Variable has a
        leading member axis).
      n: number of members.
      mesh: the ``('ensemble', 'data', 'model')`` mesh the state lives on.
      rules: logical axis rules (merged over :data:`ensemble.DEFAULT_RULES`).
      in_axes: default input axes: ``None`` shared inputs, ``0`` per-member inputs (leading n), or
        one of those per positional argument.
      data_parallel: when a member spans several devices (``'data'`` axis > 1), split the axis
        after the member axis of array inputs (the batch) over them.

    Example:
      >>> import jax, jax.numpy as jnp, ensemble
      >>> from flax import nnx
      >>> ens = ensemble.build(lambda rngs: nnx.Linear(3, 2, rngs=rngs), 8)
      >>> ens(jnp.ones((5, 3))).shape
      (8, 5, 2)
      >>> ens.member(3)(jnp.ones((5, 3))).shape
      (5, 2)
    """

    def __init__(
        self,
        members: nnx.Module,
        n: int,
        mesh: Mesh,
        rules: LogicalRules,
        in_axes: InAxes = None,
        data_parallel: bool = True,
    ):
        self.members = members
        self.n = int(n)
        self.mesh = mesh
        self.rules = merge_rules(rules)
        self.in_axes = _check_in_axes(in_axes)
        self.data_parallel = bool(data_parallel)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs every member on the inputs; outputs get a leading member axis of size n.

        Called eagerly, the whole ensemble call is compiled once (``nnx.jit``; array inputs are
        traced, other inputs are static) instead of dispatching every vmapped op on its own.
        Inside ``nnx.jit`` / ``nnx.grad`` it simply traces. For op-by-op debugging use
        ``ens.map(lambda m, *a: m(*a), *args)``.
        """
        if not _tracing():
            split = _split_static(args, kwargs)
            if split is not None:
                dynamic, static = split
                return _compiled_call(self, dynamic, static)
        return self.map(_call_module, *args, **kwargs)

    def map(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn(member_module, *args, **kwargs)`` for every member; stacks results on axis 0.

        ``fn`` sees one PLAIN member module (as the factory built it), so any method or loss
        written for the single model works unchanged. Inputs follow :attr:`in_axes`. Variable
        updates made by ``fn`` (batch statistics, rng counts) are written back per member.

        Example:
          >>> import jax.numpy as jnp, ensemble
          >>> from flax import nnx
          >>> ens = ensemble.build(lambda rngs: nnx.Linear(3, 2, rngs=rngs), 4)
          >>> ens.map(lambda m, x: (m(x) ** 2).mean(), jnp.ones((5, 3))).shape
          (4,)
        """
        return self._map(fn, args, kwargs, self.in_axes)

    def member(self, i: int) -> nnx.Module:
        """Returns member ``i`` as a plain module (same class as the factory's output).

        Its output equals row ``i`` of the ensemble's output. Its arrays stay on the device(s)
        that already held member ``i`` (no gather, no copy to other devices); move them with
        ``jax.device_put`` if needed. Variables are new objects: changing the member leaves the
        ensemble untouched.

        Example:
          >>> import numpy as np, jax.numpy as jnp, ensemble
          >>> from flax import nnx
          >>> ens = ensemble.build(lambda rngs: nnx.Linear(3, 2, rngs=rngs), 4)
          >>> np.allclose(ens.member(1)(jnp.ones(3)), ens(jnp.ones(3))[1])
          True
        """
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or not -self.n <= i < self.n:
            raise IndexError(f"member index must be an integer in [0, {self.n}), got {i!r}.")
        graphdef, state = nnx.split(self.members)
        # tree.map builds new Variables, so stripping the member axis from their sharding
        # metadata below leaves the ensemble's own Variables untouched.
        i = int(i) % self.n
        state = jax.tree.map(lambda x: take_member(x, i, self.mesh, self.n), state)
        state = nnx_spmd.remove_axis(state, 0, _TRANSFORM_METADATA)
        return nnx.merge(graphdef, state)

    # -- internals -------------------------------------------------------------------------------

    def _map(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        in_axes: InAxes,
    ) -> Any:
        axes = _arg_axes(in_axes, len(args))
        kw_axis = in_axes if isinstance(in_axes, int) else None
        with _scope(self.mesh, self.rules):
            args = tuple(
                self._place_input(a, ax, f"args[{j}]") for j, (a, ax) in enumerate(zip(args, axes))
            )
            kwargs = {k: self._place_input(v, kw_axis, f"{k}=") for k, v in kwargs.items()}

            mapped = [a for a, ax in zip(args, axes) if ax == 0]
            mapped_kw = {k: v for k, v in kwargs.items() if kw_axis == 0}
            shared_kw = {k: v for k, v in kwargs.items() if kw_axis != 0}

            def one_member(members, mapped, mapped_kw):
                it = iter(mapped)
                full = [next(it) if ax == 0 else a for a, ax in zip(args, axes)]
                return fn(members, *full, **shared_kw, **mapped_kw)

            # spmd_axis_name: sharding constraints inside a member keep the member axis sharded
            # (without it, a constraint on a member-local array would gather all members).
            out = nnx.vmap(
                one_member,
                in_axes=(0, 0, 0),
                out_axes=0,
                axis_size=self.n,
                spmd_axis_name=MEMBER_AXIS,
                transform_metadata=_TRANSFORM_METADATA,
            )(self.members, mapped, mapped_kw)
            return jax.tree.map(self._place_output, out)

    def _place_input(self, x: Any, axis: int | None, where: str) -> Any:
        """Shared inputs: data parallel inside a member; per-member inputs: on the member axis."""

        def place(path, leaf):
            if not isinstance(leaf, (jax.Array, np.ndarray)):
                if axis == 0:
                    raise TypeError(
                        f"per-member input {where}{jax.tree_util.keystr(path)} is a "
                        f"{type(leaf).__name__}; per-member inputs (in_axes=0) must be arrays "
                        f"with a leading member axis of size n={self.n}."
                    )
                return leaf
            shape = np.shape(leaf)
            if axis == 0 and (not shape or shape[0] != self.n):
                raise ValueError(
                    f"per-member input {where}{jax.tree_util.keystr(path)} has shape {shape}; "
                    f"in_axes=0 needs a leading member axis of size n={self.n}. Pass shared "
                    "inputs with in_axes=None."
                )
            spec = [MEMBER_AXIS] if axis == 0 else []
            inner = shape[len(spec) :]
            data = self.mesh.shape.get(DATA_AXIS, 1)
            if self.data_parallel and data > 1 and inner and inner[0] % data == 0:
                # A member spanning several devices splits its batch over them (data parallel).
                spec.append(DATA_AXIS)
            if not spec:
                return leaf
            return jax.lax.with_sharding_constraint(
                leaf, NamedSharding(self.mesh, PartitionSpec(*spec))
            )

        return jax.tree_util.tree_map_with_path(place, x)

    def _place_output(self, y: Any) -> Any:
        shape = np.shape(y)
        if not isinstance(y, jax.Array) or not shape or shape[0] != self.n:
            return y
        rest = (PartitionSpec.UNCONSTRAINED,) * (len(shape) - 1) if _tracing() else ()
        return jax.lax.with_sharding_constraint(
            y, NamedSharding(self.mesh, PartitionSpec(MEMBER_AXIS, *rest))
        )


def _call_module(module: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def _split_static(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[list, Any] | None:
    """Array leaves (traced) and a hashable rest (static); None when the inputs cannot be split
    that way (graph nodes or unhashable non-array leaves), so the call stays eager."""
    is_node = lambda x: isinstance(x, (nnx.Module, nnx.Variable, nnx.Rngs))
    leaves, treedef = jax.tree_util.tree_flatten((args, dict(kwargs)), is_leaf=is_node)
    dynamic_mask = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
    if any(is_node(x) for x in leaves):
        return None
    static = (treedef, dynamic_mask, tuple(None if d else x for x, d in zip(leaves, dynamic_mask)))
    try:
        hash(static)
    except TypeError:
        return None
    return [x for x, d in zip(leaves, dynamic_mask) if d], static


@functools.partial(nnx.jit, static_argnums=2)
def _compiled_call(ens: NNXEnsemble, dynamic: list, static: Any) -> Any:
    treedef, dynamic_mask, fixed = static
    it = iter(dynamic)
    leaves = [next(it) if d else x for x, d in zip(fixed, dynamic_mask)]
    args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    return ens._map(_call_module, args, kwargs, ens.in_axes)


def _check_in_axes(in_axes: Any) -> InAxes:
    ok = lambda a: a is None or (isinstance(a, int) and not isinstance(a, bool) and a == 0)
    if ok(in_axes):
        return in_axes
    if isinstance(in_axes, (tuple, list)) and all(ok(a) for a in in_axes):
        return tuple(in_axes)
    raise ValueError(
        f"in_axes must be None (inputs shared by all members), 0 (per-member inputs with a "
        f"leading axis of size n) or a tuple of those, one per positional input; got {in_axes!r}."
    )


def _arg_axes(in_axes: InAxes, nargs: int) -> tuple[int | None, ...]:
    if not isinstance(in_axes, tuple):
        return (in_axes,) * nargs
    if len(in_axes) != nargs:
        raise ValueError(
            f"in_axes={in_axes} gives {len(in_axes)} axes but the call has {nargs} positional "
            "inputs; give one axis (None or 0) per positional input."
        )
    return in_axes


# ------------------------------------------------------------------------------------------------
# Building
# ------------------------------------------------------------------------------------------------


def build_nnx(
    factory: Callable[[nnx.Rngs], nnx.Module] | type[nnx.Module],
    n: int,
    *,
    mesh: Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    model_parallel: int = 1,
    rules: Sequence[tuple[str, Any]] | None = None,
    in_axes: InAxes = None,
    rngs: RngsLike = 0,
    data_parallel: bool = True,
    **module_kwargs: Any,
) -> NNXEnsemble:
    """Builds an n-member NNX ensemble whose state is created straight into its shards.

    Args:
      factory: ``rngs -> nnx.Module`` (a lambda, a function, ``functools.partial(MyModule,
        ...)``), or an ``nnx.Module`` subclass called as ``factory(**module_kwargs, rngs=rngs)``.
        It is called once per member (vmapped), with that member's own ``nnx.Rngs``.
      n: number of members.
      mesh: a mesh with an ``'ensemble'`` axis (default: :func:`ensemble.make_mesh`).
      devices: devices for the default mesh (default: all).
      model_parallel: devices per member for tensor parallelism (reached through ``rules``).
      rules: logical axis rules for ``nnx.with_partitioning`` names, merged over
        :data:`ensemble.DEFAULT_RULES`, e.g. ``[('hidden', 'model')]``.
      in_axes: default for calls: ``None`` inputs shared by all members, ``0`` per-member inputs
        (leading axis n), or a tuple with one of those per positional input.
      rngs: an int seed, a ``jax.random.key``, a mapping ``{stream: seed or key}``, or an
        ``nnx.Rngs`` (one key is drawn from each of its streams). EVERY stream is split per
        member, so members differ in init and in dropout masks.
      data_parallel: when each member spans several devices, split inputs' batch axis over them
        (default); ``False`` keeps inputs replicated within a member.
      **module_kwargs: constructor arguments when ``factory`` is a Module subclass (names that
        clash with this function's keywords need ``functools.partial``).

    Returns:
      An :class:`NNXEnsemble`; every leaf of ``nnx.state(ens)`` has leading axis n and is split
      over the mesh's member axis (no device holds another device's members).

    Example:
      >>> import jax, jax.numpy as jnp, ensemble
      >>> from flax import nnx
      >>> ens = build_nnx(nnx.Linear, 8, in_features=3, out_features=2, rngs=0)
      >>> kernel = ens.members.kernel[...]
      >>> kernel.shape, len({s.device for s in kernel.addressable_shards})
      ((8, 3, 2), 8)
    """
    in_axes = _check_in_axes(in_axes)
    plan = _plan(factory, n, mesh, devices, model_parallel, rules, rngs, module_kwargs)
    with partitioning(plan.mesh, plan.rules):
        state = plan.init(plan.keys)
    members = nnx.merge(plan.graphdef, state)
    return NNXEnsemble(members, n, plan.mesh, plan.rules, in_axes, data_parallel)


def lower_build_nnx(
    factory: Callable[[nnx.Rngs], nnx.Module] | type[nnx.Module],
    n: int,
    *,
    mesh: Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    model_parallel: int = 1,
    rules: Sequence[tuple[str, Any]] | None = None,
    rngs: RngsLike = 0,
    **module_kwargs: Any,
) -> jax.stages.Lowered:
    """The jitted creation :func:`build_nnx` runs, lowered, to inspect without running it.

    ``.compile().memory_analysis()`` gives the per-device bytes of the initialisation: its
    output is each device's share of the state (nothing is created whole and then split).

    Example:
      >>> from flax import nnx
      >>> lowered = lower_build_nnx(nnx.Linear, 8, in_features=64, out_features=64)
      >>> lowered.compile().memory_analysis().output_size_in_bytes // 1024  # KiB per device
      16
    """
    plan = _plan(factory, n, mesh, devices, model_parallel, rules, rngs, module_kwargs)
    with partitioning(plan.mesh, plan.rules):
        return plan.init.lower(plan.keys)


class _Plan(NamedTuple):
    mesh: Mesh
    rules: LogicalRules
    keys: dict[str, jax.Array]
    graphdef: Any
    init: Any  # jax.jit(create, out_shardings=...)


def _plan(
    factory: Any,
    n: int,
    mesh: Mesh | None,
    devices: Sequence[jax.Device] | None,
    model_parallel: int,
    rules: Sequence[tuple[str, Any]] | None,
    rngs: RngsLike,
    module_kwargs: Mapping[str, Any],
) -> _Plan:
    """Validates the arguments, traces the creation abstractly and jits it with out_shardings."""
    make_member = _as_factory(factory, module_kwargs)
    mesh = resolve_mesh(n, mesh, devices, model_parallel)
    rules = merge_rules(rules)
    keys = _stream_keys(rngs)

    def create(keys: dict[str, jax.Array]) -> nnx.Module:
        per_member = {k: jax.random.split(v, n) for k, v in keys.items()}

        @nnx.vmap(
            in_axes=0,
            out_axes=0,
            axis_size=n,
            spmd_axis_name=MEMBER_AXIS,
            transform_metadata=_TRANSFORM_METADATA,
        )
        def one_member(member_keys):
            module = make_member(nnx.Rngs(**member_keys))
            if not isinstance(module, nnx.Module):
                raise TypeError(
                    f"the factory must return an nnx.Module, got {type(module).__name__}. Pass "
                    "a callable rngs -> nnx.Module, e.g. lambda rngs: MyModule(..., rngs=rngs)."
                )
            return module

        return one_member(per_member)

    # Annotated Variables shard themselves at creation (flax's eager sharding), which needs the
    # mesh and rules in scope; the abstract trace gives every leaf's shape and annotation.
    with partitioning(mesh, rules):
        graphdef, abstract = nnx.split(nnx.eval_shape(create, keys))
        shardings = _member_shardings(abstract, mesh, n, rules)
    treedef = jax.tree.structure(abstract)

    def member_leaves(member_keys: dict[str, jax.Array]) -> list[jax.Array]:
        return jax.tree.leaves(nnx.state(make_member(nnx.Rngs(**member_keys))))

    def create_state(keys: dict[str, jax.Array]) -> Any:
        # The arrays come from the plain factory, one member at a time on each device
        # (vmap_members: a batched LAPACK call per device, e.g. orthogonal init, can hang on CPU);
        # the Variables and their member-axis metadata are those of the vmapped creation above.
        per_member = {k: jax.random.split(v, n) for k, v in keys.items()}
        leaves = vmap_members(member_leaves, n, mesh)(per_member)
        return jax.tree.unflatten(treedef, leaves)

    # Every leaf comes out of this jit already in its shard: no full copy on any device.
    init = jax.jit(create_state, out_shardings=shardings)
    return _Plan(mesh, rules, keys, graphdef, init)


def _as_factory(factory: Any, module_kwargs: Mapping[str, Any]) -> Callable[[nnx.Rngs], Any]:
    if isinstance(factory, nnx.Module):
        raise TypeError(
            f"got an nnx.Module instance ({type(factory).__name__}); an ensemble needs a factory "
            f"that builds one member from its rngs, e.g. lambda rngs: {type(factory).__name__}"
            "(..., rngs=rngs), so that each member gets its own initialisation."
        )
    if isinstance(factory, nn.Module):
        raise TypeError(
            f"got a linen Module ({type(factory).__name__}); use ensemble.build(module, n) for "
            "linen modules. build_nnx takes a factory rngs -> nnx.Module."
        )
    if isinstance(factory, type) and issubclass(factory, nnx.Module):
        return functools.partial(_construct, factory, module_kwargs)
    if not callable(factory):
        raise TypeError(
            f"factory must be a callable rngs -> nnx.Module or an nnx.Module subclass, got "
            f"{type(factory).__name__}."
        )
    if module_kwargs:
        raise TypeError(
            f"module keyword arguments {sorted(module_kwargs)} are only accepted with an "
            "nnx.Module subclass as factory; for other callables bind them yourself "
            "(functools.partial or a lambda)."
        )
    return factory


def _construct(cls: type[nnx.Module], kwargs: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
    return cls(**kwargs, rngs=rngs)


def _stream_keys(rngs: RngsLike) -> dict[str, jax.Array]:
    """One typed key per rng stream; each is split into n member keys inside the creation."""
    if isinstance(rngs, nnx.Rngs):
        return {name: rngs[name]() for name in rngs}
    if isinstance(rngs, Mapping):
        return {str(k): _as_key(v) for k, v in rngs.items()}
    return {"default": _as_key(rngs)}


def _as_key(seed: Any) -> jax.Array:
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return jax.random.key(int(seed))
    if isinstance(seed, (jax.Array, np.ndarray)):
        if jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key) and seed.shape == ():
            return seed
        if seed.dtype == np.uint32 and seed.shape == (2,):
            return jax.random.wrap_key_data(seed)
    raise TypeError(
        f"rngs must be an int seed, a scalar jax.random.key, a mapping {{stream: seed}} or an "
        f"nnx.Rngs; got {type(seed).__name__} {getattr(seed, 'shape', '')}."
    )


def _member_shardings(abstract: Any, mesh: Mesh, n: int, rules: LogicalRules) -> Any:
    """A NamedSharding per Variable: leading n on the member axis, annotated axes by rules."""

    def sharding(v: Any) -> Any:
        if not isinstance(v, nnx.Variable):
            shape = np.shape(v)
            return _leaf_sharding(shape, None, mesh, n, rules)
        shape = np.shape(v.get_value())
        names = v.get_metadata().get("out_sharding")
        return v.replace(_leaf_sharding(shape, names, mesh, n, rules))

    return jax.tree.map(sharding, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _leaf_sharding(
    shape: tuple[int, ...], names: Any, mesh: Mesh, n: int, rules: LogicalRules
) -> NamedSharding:
    if len(shape) >= 1 and shape[0] == n:
        logical = tuple(names) if isinstance(names, (tuple, list, PartitionSpec)) else None
        return member_sharding(mesh, len(shape), logical, rules)
    # Not member-shaped (e.g. the optimizer's global step count): replicated, it is tiny.
    return NamedSharding(mesh, PartitionSpec())


# ------------------------------------------------------------------------------------------------
# Optimizer and train step
# ------------------------------------------------------------------------------------------------


def nnx_optimizer(
    ens: NNXEnsemble,
    tx: optax.GradientTransformation,
    *,
    wrt: Any = nnx.Param,
    **hyperparams: Sequence[float] | jax.Array,
) -> nnx.Optimizer:
    """An ``nnx.Optimizer`` for ``ens`` with one optax state per member, placed on the member axis.

    ``tx`` is vmapped over members (:func:`ensemble.per_member`), so ``clip_by_global_norm`` and
    friends see one member at a time. ``hyperparams`` give per-member values (length n) for
    hyperparameters of a ``tx`` made with ``optax.inject_hyperparams``. The state (moments,
    counts, injected hyperparameters) is created under ``jax.jit(..., out_shardings=...)``.

    Example:
      >>> import jax.numpy as jnp, optax, ensemble
      >>> from flax import nnx
      >>> ens = ensemble.build(lambda rngs: nnx.Linear(3, 2, rngs=rngs), 4)
      >>> tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
      >>> opt = nnx_optimizer(ens, tx, learning_rate=[1e-3, 1e-3, 3e-4, 1e-4])
      >>> opt.opt_state.hyperparams["learning_rate"][...].shape
      (4,)
    """
    if not isinstance(ens, NNXEnsemble):
        raise TypeError(
            f"nnx_optimizer needs an NNXEnsemble (from ensemble.build), got {type(ens).__name__}."
        )
    member_tx = per_member(tx, ens.n, **hyperparams)
    graphdef, ens_state = nnx.split(ens)

    def create(ens_state: Any) -> nnx.Optimizer:
        return nnx.Optimizer(nnx.merge(graphdef, ens_state), member_tx, wrt=wrt)

    with partitioning(ens.mesh, ens.rules):
        opt_graphdef, abstract = nnx.split(nnx.eval_shape(create, ens_state))
        shardings = _member_shardings(abstract, ens.mesh, ens.n, ens.rules)
        state = jax.jit(lambda s: nnx.state(create(s)), out_shardings=shardings)(ens_state)
    return nnx.merge(opt_graphdef, state)


class NNXTrainStep:
    """A jitted, donated train step for an :class:`NNXEnsemble` (see :func:`nnx_train_step`)."""

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        per_member_batch: bool | tuple[bool, ...],
        has_aux: bool,
        donate: bool,
    ):
        self.loss_fn = loss_fn
        self.per_member_batch = per_member_batch
        self.has_aux = has_aux
        self.donate = donate
        functools.update_wrapper(self, loss_fn, updated=())
        self._jitted = jax.jit(
            self._step, static_argnums=(0, 1), donate_argnums=(2, 3) if donate else ()
        )

    def __call__(self, ens: NNXEnsemble, optimizer: nnx.Optimizer, *batch: Any) -> Any:
        """Updates ``ens`` and ``optimizer`` in place; returns per-member losses ``[n]``."""
        _check_pair(ens, optimizer)
        ens_def, ens_state = nnx.split(ens)
        opt_def, opt_state = nnx.split(optimizer)
        out, new_ens, new_opt = self._jitted(ens_def, opt_def, ens_state, opt_state, batch)
        # The donated input buffers are gone; point the live modules at the new ones.
        nnx.update(ens, new_ens)
        nnx.update(optimizer, new_opt)
        return out

    def lower(self, ens: NNXEnsemble, optimizer: nnx.Optimizer, *batch: Any) -> Any:
        """``jax.stages.Lowered`` of the step, e.g. for ``.compile().memory_analysis()``."""
        _check_pair(ens, optimizer)
        ens_def, ens_state = nnx.split(ens)
        opt_def, opt_state = nnx.split(optimizer)
        return self._jitted.lower(ens_def, opt_def, ens_state, opt_state, batch)

    def _step(self, ens_def, opt_def, ens_state, opt_state, batch):
        ens = nnx.merge(ens_def, ens_state)
        optimizer = nnx.merge(opt_def, opt_state)
        if isinstance(self.per_member_batch, tuple):
            in_axes = tuple(0 if b else None for b in self.per_member_batch)
        else:
            in_axes = 0 if self.per_member_batch else None

        def total(ens: NNXEnsemble):
            out = ens._map(self.loss_fn, batch, {}, in_axes)
            losses, aux = out if self.has_aux else (out, None)
            if jnp.shape(losses) != (ens.n,):
                raise ValueError(
                    f"loss_fn must return a scalar loss per member, got shape "
                    f"{jnp.shape(losses)[1:]} per member."
                )
            # Members share no parameters, so the gradient of the sum is each member's own.
            return losses.sum(), (losses, aux)

        grad_fn = nnx.value_and_grad(total, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)
        (_, (losses, aux)), grads = grad_fn(ens)
        optimizer.update(ens, grads)
        out = (losses, aux) if self.has_aux else losses
        return out, nnx.state(ens), nnx.state(optimizer)


def _check_pair(ens: Any, optimizer: Any) -> None:
    if not isinstance(ens, NNXEnsemble):
        raise TypeError(f"expected an NNXEnsemble first, got {type(ens).__name__}.")
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"expected an nnx.Optimizer second (from ensemble.nnx_optimizer), got "
            f"{type(optimizer).__name__}."
        )


def nnx_train_step(
    loss_fn: Callable[..., Any],
    *,
    per_member_batch: bool | Sequence[bool] = False,
    has_aux: bool = False,
    donate: bool = True,
) -> NNXTrainStep:
    """Makes ``step(ens, optimizer, *batch) -> losses[n]``: jitted, donated, per-member.

    ``loss_fn(member, *batch) -> scalar`` is the plain single-model loss on ONE member module;
    it is vmapped over members. Each member's gradient is its own, and the update is
    ``optimizer.update(ens, grads)`` with the per-member optax state of :func:`nnx_optimizer`.
    ``ens`` and ``optimizer`` are updated in place; with ``donate=True`` their old buffers are
    donated to the step (reused for the new state, not copied). With ``has_aux=True``, ``loss_fn``
    returns ``(loss, aux)`` and the step returns ``(losses, aux)``, aux stacked per member.

    Args:
      loss_fn: ``(member_module, *batch) -> scalar`` (or ``(scalar, aux)``).
      per_member_batch: batch leaves have a leading member axis n (e.g. bootstrapped data);
        default: one batch shared by all members. A sequence of bools decides per batch argument
        (e.g. ``(True, False)``: per-member inputs, shared targets).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      donate: donate the ensemble's and the optimizer's state buffers.

    Example:
      >>> import jax.numpy as jnp, optax, ensemble
      >>> from flax import nnx
      >>> ens = ensemble.build(lambda rngs: nnx.Linear(3, 1, rngs=rngs), 4)
      >>> opt = ensemble.nnx_optimizer(ens, optax.sgd(0.1))
      >>> step = nnx_train_step(lambda m, x, y: ((m(x) - y) ** 2).mean())
      >>> step(ens, opt, jnp.ones((8, 3)), jnp.zeros((8, 1))).shape
      (4,)
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (member, *batch) -> scalar, got {loss_fn!r}.")
    if isinstance(per_member_batch, (list, tuple)):
        per_member_batch = tuple(bool(b) for b in per_member_batch)
    else:
        per_member_batch = bool(per_member_batch)
    return NNXTrainStep(loss_fn, per_member_batch, bool(has_aux), bool(donate))
