"""Per-member optimizers: one optax state per member, updated one member at a time."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ensemble._mesh import MEMBER_AXIS, layout, no_mesh_set


def as_transformation(tx: Any) -> optax.GradientTransformation:
    """``tx`` as a plain ``GradientTransformation``: ``optax.MultiSteps`` (a wrapper object)
    becomes its ``gradient_transformation()``; anything else that is not one is a TypeError."""
    if not isinstance(tx, optax.GradientTransformation) and callable(
        getattr(tx, "gradient_transformation", None)
    ):
        tx = tx.gradient_transformation()
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            "tx must be an optax.GradientTransformation for ONE member (e.g. "
            f"optax.adam(1e-3)); got {type(tx).__name__}. train_step makes it per-member."
        )
    return tx


def per_member(
    tx: optax.GradientTransformation,
    n: int,
    **hyperparams: Sequence[float] | jax.Array,
) -> optax.GradientTransformation:
    """Vmaps ``tx`` over the leading member axis, so each member gets its own optimizer state.

    Global transforms (``optax.clip_by_global_norm``, ``optax.contrib.*`` with norms) see one
    member at a time: a huge gradient on member 0 does not rescale member 1's update.

    ``hyperparams`` give per-member values (length n) for hyperparameters of a ``tx`` made with
    ``optax.inject_hyperparams``, e.g. ``learning_rate=[1e-3, 3e-4, ...]``.

    ``init`` puts the state where the params' members are: called eagerly on member-sharded
    params, each moment gets its parameter's sharding and every other ``[n, ...]`` leaf the
    member axis; inside your ``jit``, under ``jax.set_mesh`` / ``ensemble.sharding.partitioning``,
    ``[n, ...]`` leaves go on the member axis (in a plain ``jit`` give ``out_shardings``: the
    params' placement is not known there).

    Example:
      >>> import optax, jax.numpy as jnp
      >>> tx = per_member(optax.inject_hyperparams(optax.adam)(1e-3), 2, learning_rate=[1e-3, 1e-4])
      >>> state = tx.init({"w": jnp.zeros((2, 3))})
      >>> optax.tree_utils.tree_get(state, "learning_rate").shape
      (2,)
    """
    layout(n, 1)  # n must be a positive integer
    tx = optax.with_extra_args_support(as_transformation(tx))
    with no_mesh_set():  # closed over by the step's program: tied to no mesh of the caller's
        traced = lambda v: any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(v))
        values = {k: jnp.asarray(v if traced(v) else np.asarray(v)) for k, v in hyperparams.items()}
    for name, v in values.items():
        if v.shape != (n,):
            raise ValueError(
                f"per-member hyperparameter {name!r} must have one value per member "
                f"(shape ({n},)), got shape {v.shape}."
            )

    def init_core(params: Any) -> Any:
        state = jax.vmap(tx.init, spmd_axis_name=MEMBER_AXIS)(params)
        if values:
            _check_injected(state, sorted(values))
            # In the dtype optax injected (float64 under jax_enable_x64, as plain optax keeps).
            dtype = lambda k: jnp.asarray(optax.tree_utils.tree_get(state, k)).dtype
            state = optax.tree_utils.tree_set(
                state, **{k: v.astype(dtype(k)) for k, v in values.items()}
            )
        return state

    def init_fn(params: Any) -> Any:
        _check_member_axis(params, n)
        return _placed_like(tx, init_core, params, n)

    def update_fn(
        updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        _check_extra_args(extra_args, n)
        extra_args = accepted_extra_args(tx, extra_args)
        member = lambda u, s, p, kw: tx.update(u, s, p, **kw)  # p None: no leaves to map
        return jax.vmap(member, spmd_axis_name=MEMBER_AXIS)(updates, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _placed_like(tx: Any, init: Any, params: Any, n: int) -> Any:
    """``init(params)`` with the state on the params' member axis: moments shaped like a
    parameter get its sharding, other ``[n, ...]`` leaves the member axis, the rest replicated.
    Optax's zeros depend on no input, so left alone they landed on one device (the whole
    population's Adam state on device 0) or, under a mesh, on every device. Inside ``jit`` the
    params' shardings are unknown: there the ambient mesh (``jax.set_mesh``,
    ``ensemble.sharding.partitioning``) gives the member axis, or the caller's
    ``out_shardings`` place the state (as ``TrainStep.init`` does)."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
        if not _spans_members(jax.sharding.get_abstract_mesh()):
            return init(params)
        member = lambda x: jax.lax.with_sharding_constraint(x, PartitionSpec(MEMBER_AXIS))
        return jax.tree.map(lambda x: member(x) if _member_major(x, n) else x, init(params))
    placed = lambda p: (
        isinstance(s := getattr(p, "sharding", None), NamedSharding) and (_spans_members(s.mesh))
    )
    mesh = next((p.sharding.mesh for p in jax.tree.leaves(params) if placed(p)), None)
    if mesh is None:  # unplaced params, or one device
        return init(params)

    def default(x: Any) -> Any:  # the member axis alone; empty nodes (optax.MaskedNode) kept
        if not hasattr(x, "shape"):
            return x
        return NamedSharding(mesh, PartitionSpec(MEMBER_AXIS if _member_major(x, n) else None))

    abstract = jax.eval_shape(init, params)
    like = jax.tree.map(lambda p: p.sharding if placed(p) else default(p), params)
    try:
        shardings = state_shardings(tx, abstract, params, like, default)
    except Exception:  # a state optax cannot map onto the params: the member axis only
        shardings = jax.tree.map(default, abstract)
    return jax.jit(init, out_shardings=shardings)(params)  # straight into the shards


def state_shardings(
    tx: Any, abstract: Any, params: Any, param_shardings: Any, default: Callable[[Any], Any]
) -> Any:
    """Per leaf of a per-member optimizer state (``abstract``, shapes of ``per_member(tx,
    n).init(params)``): a moment shaped like its parameter gets that parameter's sharding (split
    on 'model' too, say), found through optax's map of the state onto the params, so by its
    parameter's place in the tree (matched by shape, the first of two same-shaped parameters
    split differently gave its sharding to both moments); anything else ``default(leaf)``.
    Raises where optax cannot map the state onto the params."""
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), np.float32), params)

    def like_param(leaf: Any, sharding: Any, shape: Any) -> Any:
        if not hasattr(leaf, "shape"):  # masked-out parameters (optax.masked, multi_transform)
            return leaf
        return sharding if leaf.shape == shape.shape else default(leaf)

    return optax.tree_utils.tree_map_params(
        tx,
        like_param,
        abstract,
        param_shardings,
        shapes,
        transform_non_params=default,
        is_leaf=lambda x: isinstance(x, NamedSharding | optax.MaskedNode),
    )


def _member_major(x: Any, n: int) -> bool:
    return len(np.shape(x)) >= 1 and np.shape(x)[0] == n


def _spans_members(mesh: Any) -> bool:
    """A mesh with a member axis of several devices, not manual (inside a member's program)."""
    types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
    return (
        MEMBER_AXIS in types
        and mesh.shape[MEMBER_AXIS] > 1
        and all(t != jax.sharding.AxisType.Manual for t in types.values())
    )


def accepted_extra_args(
    tx: optax.GradientTransformationExtraArgs, extra_args: dict[str, Any]
) -> dict[str, Any]:
    """The optax extra update arguments (``value``, ``grad``, ``value_fn``) that ``tx.update``
    takes: all where it takes ``**extra_args`` (optax's chains and wrappers pass them on, and
    plain transforms drop them), else only those it names (``optax.contrib.sam`` names
    ``grad_fn`` alone and refuses the rest)."""
    try:
        parameters = inspect.signature(tx.update).parameters
    except (TypeError, ValueError):  # no signature to read: pass them all, as optax does
        return extra_args
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return extra_args
    return {k: v for k, v in extra_args.items() if k in parameters}


def _check_extra_args(extra_args: dict[str, Any], n: int) -> None:
    """optax's extra update arguments (``value=losses``) must be arrays, one slice per member."""
    for name, value in extra_args.items():
        for leaf in jax.tree.leaves(value):
            if callable(leaf) or np.ndim(leaf) == 0 or np.shape(leaf)[0] != n:
                raise ValueError(
                    f"per_member: extra update argument {name!r} must be arrays with one slice "
                    f"per member (leading axis {n}), e.g. value=losses of shape ({n},); got "
                    f"{type(leaf).__name__} of shape {np.shape(leaf)}. Functions such as "
                    "value_fn are passed by ensemble's own linen train step only. (The train "
                    "steps pass value= themselves, each member's loss: if you did not, this "
                    f"optimizer was made for n={n} members, not for this ensemble.)"
                )


def _check_injected(state: Any, names: list[str]) -> None:
    """Per-member values need numeric hyperparameters of ``optax.inject_hyperparams``."""
    get = optax.tree_utils.tree_get_all_with_path
    holders = [k for _, hp in get(state, "hyperparams") for k in hp]  # once per injection
    injected = set(holders)
    if not injected:
        raise ValueError(
            f"per-member hyperparameters {names} need a transform made with "
            "optax.inject_hyperparams(...), whose state holds them; tx has none."
        )
    unknown = [k for k in names if k not in injected]
    if unknown:
        raise ValueError(
            f"per-member values were given for {unknown}, which tx does not inject (its "
            f"injected hyperparameters: {sorted(injected)})."
        )
    repeated = sorted({k for k in names if holders.count(k) > 1})
    if repeated:
        raise ValueError(
            f"per-member values for {repeated} are ambiguous: tx injects each in "
            f"{max(holders.count(k) for k in repeated)} places (inject_hyperparams in several "
            "branches, e.g. of optax.multi_transform). Inject it in one branch only (e.g. "
            "optax.sgd(1e-2) without inject_hyperparams in the other), or set the values on the "
            "optimizer state yourself (optax.tree_utils.tree_set)."
        )
    scheduled = sorted({k for _, hs in get(state, "hyperparams_states") for k in hs} & set(names))
    if scheduled:
        raise ValueError(
            f"hyperparameters {scheduled} of tx are schedules, and per-member values can only "
            "replace numbers: give inject_hyperparams a number for them, or keep the schedule "
            "(one for all members) and give no per-member values for them."
        )


def _check_member_axis(tree: Any, n: int) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shape = jnp.shape(leaf)
        if not shape or shape[0] != n:
            raise ValueError(
                f"leaf {jax.tree_util.keystr(path)} has shape {shape}; every leaf a per-member "
                f"optimizer sees needs a leading member axis of size n={n}. If the parameters "
                "have it, the optimizer may be per-member twice: give train_step (and "
                "ensemble.per_member) the plain optax optimizer of one member."
            )
