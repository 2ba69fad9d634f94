"""Flax NNX ensembles: n members of one ``nnx.Module``, member-major and sharded over the mesh.

The ensemble is a module holding ONE member-major copy of the user's module: every Variable
(params, batch stats, rng keys and counts, anything) has a leading member axis of size n that is
split over the mesh's ``'ensemble'`` axis. Calling it runs the plain module once per member
through the member runner (``ensemble._core``), a thin adapter like the linen one: the module's
state goes in as member-major arrays, each member merges its slice into the plain module, runs
it, and its updated state (batch statistics, rng counts) comes back and is written in place.

Why the creation is jitted with ``out_shardings``: ``nnx.vmap(...,
transform_metadata={nnx.PARTITION_NAME: 'ensemble'})`` only writes ``'ensemble'`` into the
Variables' sharding *metadata*; the arrays themselves stay wherever they were computed (replicated
on every device). Placement has to be asked for on the arrays: the creation is traced once
abstractly (``nnx.eval_shape``), every leaf gets a member-axis sharding, and the real creation
runs under ``jax.jit(..., out_shardings=...)`` so each device only ever materialises its own
members.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.extend.core as jex_core
import numpy as np
import optax
from flax import nnx
from flax.nnx import spmd as nnx_spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ensemble._core import (
    BATCH_FIXES,
    INPUT_FIXES,
    InAxes,
    Members,
    ProgramCache,
    arg_axes,
    batch_default,
    check_in_axes,
    check_inputs,
    check_live,
    check_member_major,
    check_not_donated,
    check_on_mesh,
    check_shared_kwargs,
    check_stacked_inputs,
    explained_errors,
    join_static,
    key_on,
    split_loss,
    split_static,
    stream_keys,
    typed,
)
from ensemble._grouped_convs import refuse_split_grouped_convs
from ensemble._linen import warn_if_model_axis_unused, warn_unmapped
from ensemble._mesh import (
    MEMBER_AXIS,
    LogicalRules,
    as_if_outside_meshes,
    check_split,
    kept_sharding,
    member_index,
    member_pspec,
    merge_rules,
    own_mesh,
    partitioning,
    resolve_mesh,
    take_member,
)
from ensemble._optim import per_member
from ensemble._outside import OutsideValues
from ensemble._steps import one_step_of, scan_steps, stacked_flags, traced_batch
from ensemble._warn import warn_user

__all__ = ["NNXEnsemble", "build_nnx", "lower_build_nnx", "nnx_optimizer", "nnx_train_step"]

RngsLike = int | jax.Array | nnx.Rngs | Mapping[str, Any]

_TRANSFORM_METADATA = {nnx.PARTITION_NAME: MEMBER_AXIS}


def _tracing(*trees: Any) -> bool:
    """True when any array in ``trees`` is being traced (inside jit, grad, vmap)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


#: What to do about an NNX state whose buffers a train step took (it updates in place).
_KEEP_A_COPY = (
    "a train step updates the ensemble and its optimizer in place and donates their old "
    "buffers, so a state taken before it (nnx.state, a pure dict) is gone after it, also after "
    "a step that failed while it ran: keep a copy (jax.tree.map(jnp.copy, nnx.state(ens))), "
    "make the step with donate=False, or restore a checkpoint"
)


class _MemberKeys(NamedTuple):
    """An ``nnx.Rngs`` argument turned into one key per stream, split per member on the way in
    and rebuilt as the member's own ``nnx.Rngs``."""

    keys: dict[str, jax.Array]


# ------------------------------------------------------------------------------------------------
# The ensemble module
# ------------------------------------------------------------------------------------------------


class NNXEnsemble(nnx.Module):
    """n members of one NNX module, stored member-major and sharded over ``mesh``'s member axis.

    Build it with :func:`ensemble.build` (or :func:`build_nnx`); the constructor only wraps a
    module whose state is already member-major and placed.

    Calling the ensemble runs every member and returns outputs with a leading axis of size n,
    sharded on the member axis. It is an ordinary ``nnx.Module``: ``nnx.jit``, ``nnx.grad``,
    ``.train()`` / ``.eval()`` and ``nnx.state`` all work on it (its optimizer comes from
    :func:`nnx_optimizer`, whose optax state is per member; the train step refuses a plain
    ``nnx.Optimizer``). An
    ``nnx.Rngs`` passed to a call (``ens(x, rngs=nnx.Rngs(0))``, as the Flax tutorials write
    Dropout) gives member i the streams ``jax.random.split(rngs[stream](), n)[i]``.

    Attributes:
      members: the member-major module (same class as the factory's output; every Variable has a
        leading member axis).
      n: number of members.
      mesh: the ``('ensemble', 'data', 'model')`` mesh the state lives on.
      rules: logical axis rules (merged over :data:`ensemble.sharding.DEFAULT_RULES`).
      in_axes: default input axes: ``None`` shared inputs, ``0`` per-member inputs (leading n), or
        one of those per positional argument.
      data_parallel: when a member spans several devices (``'data'`` axis > 1), split the axis
        after the member axis of array inputs (the batch) over them.
      axis_name: name bound inside each member to its data-parallel axis (``pmap``-style models).

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
        axis_name: str | None = None,
    ):
        self.members = members
        self.n = int(n)
        self.mesh = mesh
        self.rules = merge_rules(rules)
        self.in_axes = check_in_axes(in_axes)
        self.data_parallel = bool(data_parallel)
        self.axis_name = axis_name

    @property
    def runner(self) -> Members:
        """The member runner every computation of this ensemble goes through."""
        return Members(self.n, self.mesh, self.rules, self.axis_name, self.data_parallel)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs every member on the inputs; outputs get a leading member axis of size n.

        Called eagerly, the whole ensemble call is compiled once (jitted over the ensemble's
        state; array inputs are traced, other inputs are static). Inside ``nnx.jit`` /
        ``nnx.grad`` it simply traces.
        Only the Variables the call changes are written back (BatchNorm statistics, rng
        counts; a Variable read through a lifted transform such as ``nnx.remat`` comes back as a
        new array too), each where it was, so, like a plain module, an ensemble whose call
        changes none (eval mode) also works closed over by ``jax.jit`` or ``jax.grad``.
        """
        args, kwargs = _take_rngs((args, kwargs), self.mesh)
        state = nnx.state(self.members)
        if not _tracing(args, kwargs, state):
            split = _split_static(args, kwargs)
            if split is not None:
                self._check_inputs(args, self.in_axes, kwargs)
                check_live(state, "ensemble state ", _KEEP_A_COPY)
                dynamic, static = split
                # (as_if_outside_meshes says why a caller's mesh is set aside)
                with as_if_outside_meshes(self.mesh), explained_errors():
                    return _compiled_call(self, dynamic, static)
        return self.map(_call_module, *args, **kwargs)

    def map(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn(member_module, *args, **kwargs)`` for every member; stacks results on axis 0.

        ``fn`` sees one PLAIN member module (as the factory built it), so any method or loss
        written for the single model works unchanged. Inputs follow :attr:`in_axes`. Variable
        updates made by ``fn`` (batch statistics, rng counts) are written back per member.
        Called outside ``jit``, each call traces and compiles ``fn`` afresh (whatever it closes
        over is read anew; tens of ms for a small model); to call one ``fn`` in a loop, jit the
        loop body: ``nnx.jit(lambda ens, x: ens.map(fn, x))``.

        Example:
          >>> import jax.numpy as jnp, ensemble
          >>> from flax import nnx
          >>> ens = ensemble.build(lambda rngs: nnx.Linear(3, 2, rngs=rngs), 4)
          >>> ens.map(lambda m, x: (m(x) ** 2).mean(), jnp.ones((5, 3))).shape
          (4,)
        """
        args, kwargs = _take_rngs((args, kwargs), self.mesh)
        return self._map(fn, args, kwargs, self.in_axes)

    def member(self, i: int) -> nnx.Module:
        """Returns member ``i`` as a plain module (same class as the factory's output).

        Its output equals row ``i`` of the ensemble's output. Its arrays stay on the device(s)
        that already held member ``i`` (no gather, no copy to other devices); move them with
        ``jax.device_put`` if needed. Variables are new objects: changing the member leaves the
        ensemble untouched. Its state is the same pytree as the factory's module made here;
        a Variable with a sharding annotation keeps eager sharding off, so that what is made
        from it (an optimizer's moments) needs no mesh.

        Example:
          >>> import numpy as np, jax.numpy as jnp, ensemble
          >>> from flax import nnx
          >>> ens = ensemble.build(lambda rngs: nnx.Linear(3, 2, rngs=rngs), 4)
          >>> np.allclose(ens.member(1)(jnp.ones(3)), ens(jnp.ones(3))[1])
          True
        """
        i = member_index(i, self.n) % self.n
        graphdef, state = nnx.split(self.members)
        check_live(state, "ensemble state ", _KEEP_A_COPY)
        # tree.map builds new Variables, so stripping the member axis from their sharding
        # metadata below leaves the ensemble's own Variables untouched.
        state = take_member(state, i, self.mesh, self.n)
        state = nnx_spmd.remove_axis(state, 0, _TRANSFORM_METADATA)
        member = nnx.merge(graphdef, state)
        _eager_sharding_as_caller(v for _, v in nnx.iter_graph(member))
        return member

    def train_step(
        self, loss_fn: Callable[..., Any], tx: optax.GradientTransformation, **options: Any
    ) -> NNXTrainStep:
        """A train step shaped like the linen one: ``step.init()`` makes the per-member optimizer,
        ``step(ens, optimizer, *batch) -> losses[n]`` updates both in place.

        ``options``: ``per_member_batch``, ``has_aux``, ``donate``, per-member
        ``hyperparams={'learning_rate': [...]}`` for a ``tx`` made with
        ``optax.inject_hyperparams``, and ``wrt`` (which Variables ``step.init()``'s optimizer
        trains, as for :func:`nnx_optimizer`: ``nnx.LoRAParam`` trains the LoRA weights only).

        Example:
          >>> import jax.numpy as jnp, optax, ensemble
          >>> from flax import nnx
          >>> ens = ensemble.build(lambda rngs: nnx.Linear(3, 1, rngs=rngs), 4)
          >>> step = ens.train_step(lambda m, x: (m(x) ** 2).mean(), optax.sgd(0.1))
          >>> step(ens, step.init(), jnp.ones((8, 3))).shape
          (4,)
        """
        hyperparams = dict(options.pop("hyperparams", None) or {})
        wrt = options.pop("wrt", nnx.Param)
        step = nnx_train_step(loss_fn, **options)
        step.make_optimizer = functools.partial(nnx_optimizer, self, tx, wrt=wrt, **hyperparams)
        return step

    # -- internals -------------------------------------------------------------------------------

    def _check_inputs(
        self, args: tuple[Any, ...], in_axes: InAxes, kwargs: Mapping[str, Any]
    ) -> None:
        axes = arg_axes(in_axes, len(args))
        # Member keys (an nnx.Rngs passed in) are split per member by the call itself. Any
        # other input at a per-member position is checked, Python values too (refused there).
        axes = tuple(None if isinstance(x, _MemberKeys) else ax for x, ax in zip(args, axes))
        check_inputs(args, axes, self.n, "input", *INPUT_FIXES, mesh=self.mesh)
        check_shared_kwargs(kwargs, self.n, self.mesh)

    def _map(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        in_axes: InAxes,
        squeeze: bool = False,
        batched: Sequence[bool] | None = None,
    ) -> Any:
        """``batched``: per positional argument, whether it is a batch of rows to split over a
        member's devices (default: all; a scan's arguments passed once are not)."""
        axes = arg_axes(in_axes, len(args))
        kw_names = sorted(kwargs)
        inputs = (*args, *(kwargs[k] for k in kw_names))
        input_axes = (*axes, *(None for _ in kw_names))  # keyword inputs: shared, as in linen
        self._check_inputs(args, in_axes, kwargs)
        traced, rebuild, traced_axes = _split_inputs(inputs, input_axes, self.n)
        flags = (*(batched or (True,) * len(args)), *(True,) * len(kw_names))
        rows = [f for x, f in zip(inputs, flags) if isinstance(x, _MemberKeys) or _is_array_tree(x)]
        graphdef, state = nnx.split(self.members)
        check_live(state, "ensemble state ", _KEEP_A_COPY)
        member_def = _member_treedef(state)
        changed: list[bool] = []  # per state leaf: did fn set it (known while tracing)

        def one(state_leaves, *traced_inputs):
            with nnx.use_eager_sharding(False):  # as in the creation: no partly manual mesh
                module = nnx.merge(graphdef, jax.tree.unflatten(member_def, state_leaves))
                member_graphdef = nnx.graphdef(module)  # member-axis metadata removed
                full = rebuild(traced_inputs)
                out = fn(module, *full[: len(args)], **dict(zip(kw_names, full[len(args) :])))
                new_graphdef, new_state = nnx.split(module)
                _check_same_structure(member_graphdef, state, new_graphdef, new_state)
                new = jax.tree.leaves(new_state)
                changed[:] = [a is not b for a, b in zip(new, state_leaves, strict=True)]
                return out, [a for a, c in zip(new, changed) if c]

        out, new_leaves = self.runner.map(
            one,
            (jax.tree.leaves(state), *traced),
            (0, *traced_axes),
            batched=(False, *(r and not isinstance(t, _MemberKeys) for t, r in zip(traced, rows))),
            squeeze=squeeze,
        )
        _write_back(self.members, state, changed, new_leaves)
        # Variables fn made (values sown and captured) were made in the member's context.
        _eager_sharding_as_caller(jax.tree.leaves(out, is_leaf=_is_variable))
        return out


def _check_no_raw_arrays(module: nnx.Module) -> None:
    """Refuses an array kept outside any ``nnx.Variable`` (a plain or ``nnx.data`` attribute):
    the member axis, its placement and the write-back after a call all go one Variable at a
    time, so such an array could not be split over the members."""
    nodes = list(nnx.iter_graph(module))
    modules = {path: type(node).__name__ for path, node in nodes if isinstance(node, nnx.Module)}
    for path, node in nodes:
        if isinstance(node, (jax.Array, jax.ShapeDtypeStruct)):
            name = ".".join(map(str, path))
            owner_path = max((p for p in modules if path[: len(p)] == p), key=len)
            owner = modules[owner_path]
            attr = path[len(owner_path)] if len(path) > len(owner_path) else path[-1]
            raise TypeError(
                f"the factory's module keeps an array outside any nnx.Variable, at {name!r} "
                f"(attribute {attr!r} of a {owner}); each member needs its own, so keep it in "
                f"a Variable (self.{attr} = nnx.Variable(array), or nnx.Param to train it). "
                "A Flax layer that keeps arrays so (nnx.WeightNorm's scales) needs a version "
                "of your own that keeps them in Variables."
            )


def _check_single_array_variables(module: nnx.Module) -> None:
    """Refuses a Variable whose value is a pytree (an RNN carry kept as ``nnx.Cache((h, c))``):
    the member axis, the placement and the write-back after a call all go one array per
    Variable, and such a value crashed every call (or, under ``python -O``, wrote changes
    into other Variables)."""
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable):
            continue
        value = node.get_value()
        leaves = jax.tree.leaves(value)
        if leaves and not (len(leaves) == 1 and leaves[0] is value):
            name = ".".join(map(str, path))
            kind = type(node).__name__
            raise TypeError(
                f"the factory's module keeps a {type(value).__name__} of arrays in the "
                f"{kind} {name!r}; ensemble members need one array per Variable: keep each "
                f"part in its own (e.g. self.h = nnx.{kind}(h); self.c = nnx.{kind}(c))."
            )


def _check_same_structure(graphdef: Any, state: Any, new_graphdef: Any, new_state: Any) -> None:
    """Refuses a member call that changed the module's structure: a Variable it created
    (``self.sow``, a lazily made cache) or a Python attribute it set (``self.calls += 1``).
    Members share one structure, held once by the ensemble, so such a change could not be kept:
    it would be silently dropped (a plain module keeps it)."""
    try:
        same = new_graphdef == graphdef
    except Exception:  # a static attribute that cannot be compared: nothing to say
        return
    if same:
        return
    path = lambda p: ".".join(map(str, p))
    old_paths = {path(p) for p, _ in nnx.to_flat_state(state)}
    added = [path(p) for p, _ in nnx.to_flat_state(new_state) if path(p) not in old_paths]
    if added:
        what = f"created the Variable(s) {', '.join(added[:4])}"
        fix = (
            "create them in the factory (e.g. init_cache there), or capture sown values "
            "inside the call: ens.map(lambda m, x: nnx.capture(m, nnx.Intermediate)(x), x)"
        )
    else:
        what = "set a Python attribute of the module (not an nnx.Variable)"
        fix = "keep state that changes in calls in an nnx.Variable (e.g. nnx.BatchStat)"
    raise ValueError(
        f"an ensemble member's call {what}; ensemble members keep the structure the factory "
        f"built, so the change would be lost: {fix}."
    )


def _write_back(members: nnx.Module, state: Any, changed: list[bool], new: list[Any]) -> None:
    """Sets only the Variables the call changed (BatchNorm statistics, rng counts): like a
    plain module, an ensemble that only reads its parameters can be called inside
    ``jax.jit`` / ``jax.grad`` (setting them from another trace level is an error in NNX)."""
    flat = list(nnx.to_flat_state(state))
    if len(flat) != len(changed):  # not an assert: under python -O it would write elsewhere
        raise RuntimeError(
            f"ensemble: {len(flat)} Variables but {len(changed)} changed flags; a Variable "
            "holds more than one array."
        )
    paths = [path for (path, _), c in zip(flat, changed) if c]
    if paths:
        nnx.update(members, nnx.from_flat_state(list(zip(paths, new, strict=True))))


def _call_module(module: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def _member_treedef(state: Any) -> Any:
    """The tree structure of ONE member's state: the member axis gone from sharding metadata."""
    one = jax.tree.map(lambda x: x, state)  # new Variables: the ensemble's stay untouched
    return jax.tree.structure(nnx_spmd.remove_axis(one, 0, _TRANSFORM_METADATA))


def _take_rngs(tree: Any, mesh: Mesh) -> Any:
    """Replaces every ``nnx.Rngs`` in the inputs by one fresh key per stream (advancing it),
    on ``mesh`` (drawn under a caller's mesh, it is placed there)."""
    is_rngs = lambda x: isinstance(x, nnx.Rngs)

    def take(x: Any) -> Any:
        if not is_rngs(x):
            return x
        return _MemberKeys({name: key_on(x[name](), mesh) for name in x})

    return jax.tree.map(take, tree, is_leaf=is_rngs)


def _split_inputs(
    inputs: tuple[Any, ...], axes: tuple[int | None, ...], n: int
) -> tuple[list[Any], Callable[[tuple[Any, ...]], list[Any]], list[int | None]]:
    """Array inputs (traced through the runner, with their axes) and a function that puts the
    static rest back around them inside a member; ``_MemberKeys`` become per-member ``Rngs``."""
    traced, traced_axes, slots = [], [], []
    keys = lambda v: isinstance(v, _MemberKeys)
    nested = lambda x: any(keys(leaf) for leaf in jax.tree.leaves(x, is_leaf=keys))
    for x, ax in zip(inputs, axes):
        if not isinstance(x, _MemberKeys) and nested(x):
            raise TypeError(
                "an nnx.Rngs inside a container input (a dict, list or tuple) cannot be split "
                "per member; pass it as an argument of its own, e.g. ens(x, rngs=nnx.Rngs(0))."
            )
        if isinstance(x, _MemberKeys):
            slots.append(("rngs", len(traced)))
            traced.append(_MemberKeys({k: jax.random.split(v, n) for k, v in x.keys.items()}))
            traced_axes.append(0)
        elif _is_array_tree(x):
            slots.append(("array", len(traced)))
            traced.append(x)
            traced_axes.append(ax)
        else:
            slots.append(("static", x))

    def rebuild(values: tuple[Any, ...]) -> list[Any]:
        out = []
        for kind, v in slots:
            if kind == "static":
                out.append(v)
            elif kind == "rngs":
                out.append(nnx.Rngs(**values[v].keys))
            else:
                out.append(values[v])
        return out

    return traced, rebuild, traced_axes


def _is_array_tree(x: Any) -> bool:
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(isinstance(a, jax.Array | np.ndarray) for a in leaves)


def _split_static(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[list, Any] | None:
    """Array leaves (traced) and a hashable rest (static); None when the inputs cannot be split
    that way (graph nodes or unhashable non-array leaves), so the call stays eager."""
    is_node = lambda x: isinstance(x, (nnx.Module, nnx.Variable, nnx.Rngs))
    if any(is_node(x) for x in jax.tree.leaves((args, dict(kwargs)), is_leaf=is_node)):
        return None
    try:
        return split_static((args, dict(kwargs)), "input")
    except TypeError:
        return None


# Per ensemble, one program per static configuration (and state layout), at most
# ProgramCache.size: as one jit with the static part as a static argument, every new Python
# value (scale=float(t) each call) stayed compiled forever, host memory growing by a program per
# call. Kept per ensemble, so that many ensembles in one process (a sweep) are not taken for that.
_PROGRAMS: weakref.WeakKeyDictionary[NNXEnsemble, ProgramCache] = weakref.WeakKeyDictionary()
_PROGRAMS_KEPT = 64
_READS: weakref.WeakKeyDictionary[NNXEnsemble, OutsideValues] = weakref.WeakKeyDictionary()


def _classes(graphdef: Any) -> list[type]:
    """The classes of a graph's nodes (its modules' and Variables'), whose code a call runs."""
    return list(dict.fromkeys(n.type for n in graphdef.nodes if isinstance(n.type, type)))


#: Why a Variable of the ensemble can lack the member axis, and the fix.
_MADE_AFTER_BUILD = (
    "A Variable made on ens.members after build (init_cache, one assigned from outside) is "
    "not per member: make it in the factory (e.g. call init_cache there), so that each "
    "member gets its own."
)


def _compiled_call(ens: NNXEnsemble, dynamic: list, static: Any) -> Any:
    """The call jitted over the ensemble's state, returning the outputs and only the Variables
    it changed, kept where they were: through ``nnx.jit``, every Variable came back, so each
    call copied all the parameters and the compiler placed the copies (a bias built whole on a
    member's devices came back split over 'model', unlike its optimizer moments)."""
    graphdef, state = nnx.split(ens)
    check_member_major(state, ens.n, "nnx.state(ens)", _MADE_AFTER_BUILD)
    check_on_mesh(state, ens.mesh, "nnx.state(ens)", member_major=True)
    leaves, treedef = jax.tree.flatten(state)
    placed = tuple((np.shape(x), _placement(x)) for x in leaves)

    def make() -> Any:
        pinned = _kept_shardings(ens, state)

        def call(leaves: list, dynamic: list) -> Any:
            module = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            args, kwargs = join_static(dynamic, static)
            out = module._map(_call_module, args, kwargs, module.in_axes)
            new = jax.tree.leaves(nnx.state(module))
            return out, [_kept(a, b, s) for a, b, s in zip(new, leaves, pinned, strict=True)]

        return jax.jit(call)

    programs = _PROGRAMS.setdefault(ens, ProgramCache(_PROGRAMS_KEPT))
    outside = _READS.setdefault(ens, OutsideValues("the ensemble's call"))(*_classes(graphdef))
    program = programs.get_or_make((static, _Static(graphdef), treedef, placed, outside), make)
    out, new = program(leaves, dynamic)
    _write_back(ens, state, [x is not None for x in new], [x for x in new if x is not None])
    return out


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
    axis_name: str | None = None,
    **module_kwargs: Any,
) -> NNXEnsemble:
    """Builds an n-member NNX ensemble whose state is created straight into its shards.

    Args:
      factory: ``rngs -> nnx.Module`` (a lambda, a function, ``functools.partial(MyModule,
        ...)``), or an ``nnx.Module`` subclass called as ``factory(**module_kwargs, rngs=rngs)``.
        It is called once per member, with that member's own ``nnx.Rngs``.
      n: number of members.
      mesh: a mesh with an ``'ensemble'`` axis (default: :func:`ensemble.sharding.make_mesh`).
      devices: devices for the default mesh (default: all).
      model_parallel: devices per member for tensor parallelism (reached through ``rules``).
      rules: logical axis rules for ``nnx.with_partitioning`` names, merged over
        :data:`ensemble.sharding.DEFAULT_RULES`, e.g. ``[('hidden', 'model')]``.
      in_axes: default for calls: ``None`` inputs shared by all members, ``0`` per-member inputs
        (leading axis n), or a tuple with one of those per positional input.
      rngs: an int seed, a ``jax.random.key``, a mapping ``{stream: seed or key}``, or an
        ``nnx.Rngs`` (one key is drawn from each of its streams). EVERY stream is split per
        member (member i gets ``jax.random.split(key, n)[i]``), so members differ in init and in
        dropout masks.
      data_parallel: when each member spans several devices, split inputs' batch axis over them
        (default); ``False`` keeps inputs replicated within a member.
      axis_name: name bound inside each member to its data-parallel axis, for modules written for
        ``pmap`` (``nnx.BatchNorm(..., axis_name='batch')``).
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
    in_axes = check_in_axes(in_axes)
    mesh = resolve_mesh(n, mesh, devices, model_parallel)
    keys = _keys_on(rngs, mesh)
    with own_mesh(mesh):
        plan = _plan(factory, n, mesh, rules, keys, module_kwargs)
    with partitioning(plan.mesh, plan.rules):
        state = plan.init(plan.keys)
    members = nnx.merge(plan.graphdef, state)
    return NNXEnsemble(members, n, plan.mesh, plan.rules, in_axes, data_parallel, axis_name)


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
    mesh = resolve_mesh(n, mesh, devices, model_parallel)
    keys = _keys_on(rngs, mesh)
    with own_mesh(mesh):
        plan = _plan(factory, n, mesh, rules, keys, module_kwargs)
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
    mesh: Mesh,
    rules: Sequence[tuple[str, Any]] | None,
    keys: dict[str, jax.Array],
    module_kwargs: Mapping[str, Any],
) -> _Plan:
    """Validates the arguments, traces the creation abstractly and jits it with out_shardings."""
    make_member = _checked(_as_factory(factory, module_kwargs))
    members = Members(int(n), mesh, merge_rules(rules))

    def create(keys: dict[str, jax.Array]) -> nnx.Module:
        # Only traced abstractly: the member-major Variables and their member-axis metadata.
        vmapped = nnx.vmap(
            lambda k: make_member(nnx.Rngs(**k)),
            axis_size=n,
            transform_metadata=_TRANSFORM_METADATA,
        )
        return vmapped(members.split_keys(keys)[0])

    # Traced with no mesh: Flax would check each annotation against the mesh and refuse a
    # name that no rule maps; _member_shardings maps every name through the rules instead
    # (unmapped ones to replicated, with a warning where that drops a split).
    with nnx.use_eager_sharding(False):
        abstract_module = nnx.eval_shape(create, keys)
    _check_no_raw_arrays(abstract_module)
    _check_single_array_variables(abstract_module)
    _warn_if_rngs_unused(make_member, keys, members.n)
    graphdef, abstract = nnx.split(abstract_module)
    _warn_unmapped_nnx(abstract, members)
    shardings = _member_shardings(abstract, members.mesh, n, members.rules)
    warn_if_model_axis_unused(shardings, members.mesh)
    treedef = jax.tree.structure(abstract)

    def member_leaves(member_keys: dict[str, jax.Array]) -> list[jax.Array]:
        # Placement comes from out_shardings below; Flax's eager sharding of annotated
        # Variables refuses the member program's partly manual mesh.
        with nnx.use_eager_sharding(False):
            return jax.tree.leaves(nnx.state(make_member(nnx.Rngs(**member_keys))))

    def create_state(keys: dict[str, jax.Array]) -> Any:
        # The arrays come from the plain factory, run once per member by the member runner
        # (members sharing a device one after another); the Variables and their metadata are
        # those of the abstract creation above.
        leaves = members.map(member_leaves, (members.split_keys(keys)[0],), (0,), sequential=True)
        return jax.tree.unflatten(treedef, leaves)

    # Every leaf comes out of this jit already in its shard: no full copy on any device.
    init = jax.jit(create_state, out_shardings=shardings)
    return _Plan(members.mesh, members.rules, keys, graphdef, init)


def _checked(make_member: Callable[[nnx.Rngs], Any]) -> Callable[[nnx.Rngs], nnx.Module]:
    def make(rngs: nnx.Rngs) -> nnx.Module:
        try:
            module = make_member(rngs)
        except TypeError as e:
            if "Rngs" not in str(e):  # an error of the model's own: as it is
                raise
            # Something that is not a factory (jnp.tanh, lambda x: x * 2) used the rngs as data.
            raise TypeError(
                f"build called the model as an NNX factory, model(rngs), and it failed on the "
                f"nnx.Rngs ({e}). Pass a linen Module, or a factory that builds one member "
                "from its rngs, e.g. lambda rngs: MyModel(..., rngs=rngs)."
            ) from e
        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"the factory must return an nnx.Module, got {type(module).__name__}. Pass "
                "a callable rngs -> nnx.Module, e.g. lambda rngs: MyModule(..., rngs=rngs)."
            )
        return module

    return make


def _warn_if_rngs_unused(make_member: Callable[[nnx.Rngs], Any], keys: Any, n: int) -> None:
    """Warns when the factory draws no key from the rngs it is given and no state it makes
    depends on them (a factory that builds from its own ``nnx.Rngs(0)``, say): all n members
    are then the same model, dropout masks included, and train as one, without any error."""
    if n == 1:
        return
    drew = []

    def leaves(member_keys: dict[str, jax.Array]) -> list[jax.Array]:
        rngs = nnx.Rngs(**member_keys)
        counts = [rngs[s].count.get_value() for s in member_keys]
        with nnx.use_eager_sharding(False):
            out = jax.tree.leaves(nnx.state(make_member(rngs)))
        drew.append(any(rngs[s].count.get_value() is not c for s, c in zip(member_keys, counts)))
        return out

    jaxpr = jax.make_jaxpr(leaves)(keys).jaxpr
    # Conservative: an equation with any key-dependent input makes all its outputs so.
    dependent = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, jex_core.Literal) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    outs = [v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)]
    if drew == [False] and jaxpr.outvars and not any(v in dependent for v in outs):
        warn_user(
            f"the factory draws no key from the nnx.Rngs it is given and no state it makes "
            f"depends on them, so all {n} members are the same model (same initial "
            "parameters, same dropout masks). Build the module from the factory's rngs, e.g. "
            "lambda rngs: MyModel(..., rngs=rngs), not from an nnx.Rngs made inside it.",
        )


def _warn_unmapped_nnx(abstract: Any, members: Members) -> None:
    names = [
        v.get_metadata().get("out_sharding")
        for v in jax.tree.leaves(abstract, is_leaf=_is_variable)
        if isinstance(v, nnx.Variable)
    ]
    names = [[a for a in spec if a != MEMBER_AXIS] for spec in names if spec]
    warn_unmapped(names, _with_mesh_axes(members.rules, members.mesh), members.mesh)


def _with_mesh_axes(rules: LogicalRules, mesh: Mesh) -> LogicalRules:
    """Flax NNX's reading of annotations: a name that no rule maps but that names a mesh axis
    (``nnx.with_partitioning(init, (None, 'model'))``) is that axis. Resolved through the rules
    alone, it was replicated on every device of a member."""
    mapped = {name for name, _ in rules}
    axes = [a for a in mesh.axis_names if a != MEMBER_AXIS and a not in mapped]
    return (*rules, *((a, a) for a in axes))


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
    try:
        inspect.signature(factory).bind(None)  # one positional argument: the rngs
    except TypeError:
        raise TypeError(
            "the factory is called with one argument, the member's nnx.Rngs; take it and pass "
            "it on, e.g. lambda rngs: nnx.Linear(3, 4, rngs=rngs)."
        ) from None
    except ValueError:  # no signature to read (some builtins): the call itself will tell
        pass
    return factory


def _construct(cls: type[nnx.Module], kwargs: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
    return cls(**kwargs, rngs=rngs)


def _keys_on(rngs: RngsLike, mesh: Mesh) -> dict[str, jax.Array]:
    """The build's keys, one typed key per rng stream (each split into n member keys inside the
    creation), drawn where the caller's are (an ``nnx.Rngs`` made under a mesh of the caller's
    draws under it), then placed on ``mesh``."""
    if isinstance(rngs, nnx.Rngs):
        return {name: key_on(rngs[name](), mesh) for name in rngs}
    return stream_keys(rngs, "default", mesh)


def _member_shardings(
    abstract: Any, mesh: Mesh, n: int, rules: LogicalRules, named: set | None = None
) -> Any:
    """A NamedSharding per Variable: leading n on the member axis, annotated axes by rules.

    ``named``: where given, the (shape, names) pairs whose names apply; another Variable gets
    the member axis only. An optimizer's state carries its parameter's names whatever its own
    shape (Adafactor's factored moments, L-BFGS's history of updates)."""

    rules = _with_mesh_axes(rules, mesh)

    def sharding(path: Any, v: Any) -> Any:
        if not isinstance(v, nnx.Variable):
            return _leaf_sharding(path, np.shape(v), None, mesh, n, rules)
        shape = np.shape(v.get_value())
        names = _names(v)
        if named is not None and (shape, names) not in named:
            names = None
        return v.replace(_leaf_sharding(path, shape, names, mesh, n, rules))

    return jax.tree_util.tree_map_with_path(sharding, abstract, is_leaf=_is_variable)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _eager_sharding_as_caller(variables: Iterable[Any]) -> None:
    """Sets the caller's eager-sharding setting on Variables handed out of the ensemble.

    The ensemble makes and runs its members without eager sharding (placement comes from
    out_shardings), while the user's own modules have the setting in effect; a state whose
    metadata differs is another pytree, so ``jax.tree.map`` over a member's and a plain model's
    states failed. An annotated Variable keeps it off: eagerly, every Variable made from it (an
    optimizer's moments) would need a mesh its rules map, even for the member alone.
    """
    eager = nnx.using_eager_sharding()
    for v in variables:
        if _is_variable(v) and v.has_metadata("eager_sharding") and not _names(v):
            v.set_metadata(eager_sharding=eager)


def _names(v: nnx.Variable) -> tuple | None:
    names = v.get_metadata().get("out_sharding")
    return tuple(names) if isinstance(names, (tuple, list, PartitionSpec)) else None


def _leaf_sharding(
    path: Any,
    shape: tuple[int, ...],
    names: tuple | None,
    mesh: Mesh,
    n: int,
    rules: LogicalRules,
) -> NamedSharding:
    """``names``: a Variable's logical names (``_names``), or None."""
    if len(shape) >= 1 and shape[0] == n:
        spec = member_pspec(len(shape), names, rules)
        check_split(path, shape, spec, mesh)
        return NamedSharding(mesh, spec)
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
    ``wrt``, an NNX filter, sees each member's own paths, as on the plain model (``('head',
    'kernel')``, not the ensemble's ``('members', 'head', 'kernel')``), and so does ``tx``: the
    label function of ``optax.multi_transform``, ``optax.masked``'s mask and ``adamw``'s get a
    member's own tree, and the optimizer state is laid out as a member's parameters are.

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
    wrt = _member_filter(wrt)  # another optimizer's opt.wrt: the filter it was made with
    if not jax.tree.leaves(nnx.state(ens.members, wrt)):  # (per_member's vmap then failed)
        kinds = sorted({type(v).__name__ for _, v in nnx.iter_graph(ens.members)
                        if isinstance(v, nnx.Variable)})  # fmt: skip
        raise ValueError(
            f"nnx_optimizer: wrt={wrt!r} selects none of the ensemble's Variables (it has "
            f"{', '.join(kinds) or 'none'}), so there is nothing to train; give a filter that "
            "selects some (the default, nnx.Param, trains the parameters). It sees each "
            "member's own paths, as on the plain model: ('head', 'kernel'), not ('members', ...)."
        )
    member_tx = _in_members_tx(per_member(tx, ens.n, **hyperparams))
    graphdef, ens_state = nnx.split(ens)

    def create(ens_state: Any) -> nnx.Optimizer:
        return nnx.Optimizer(nnx.merge(graphdef, ens_state), member_tx, wrt=_InMembers(wrt))

    # Traced with no mesh, as in the creation: Flax would refuse an annotation name that no
    # rule maps; _member_shardings maps every name through the rules.
    with nnx.use_eager_sharding(False), as_if_outside_meshes(ens.mesh):
        opt_graphdef, abstract = nnx.split(nnx.eval_shape(create, ens_state))
    params = jax.tree.leaves(nnx.state(ens.members, wrt), is_leaf=_is_variable)
    named = {(np.shape(v.get_value()), _names(v)) for v in params}
    shardings = _member_shardings(abstract, ens.mesh, ens.n, ens.rules, named)

    def create_state(ens_state: Any) -> Any:
        with nnx.use_eager_sharding(False):  # placement comes from out_shardings
            return nnx.state(create(ens_state))

    with partitioning(ens.mesh, ens.rules):
        state = jax.jit(create_state, out_shardings=shardings)(ens_state)
    return nnx.merge(opt_graphdef, state)


class NNXTrainStep:
    """A jitted, donated train step for an :class:`NNXEnsemble` (see :func:`nnx_train_step`).

    Example:
      >>> import jax.numpy as jnp, optax, ensemble
      >>> from flax import nnx
      >>> ens = ensemble.build(lambda rngs: nnx.Linear(3, 1, rngs=rngs), n=8)
      >>> step = ens.train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
      >>> opt, x = step.init(), jnp.ones((2, 3))
      >>> first, second = step(ens, opt, x), step(ens, opt, x)
      >>> bool((second < first).all())  # the first call updated ens in place
      True
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        per_member_batch: bool | tuple[bool, ...] | None,
        has_aux: bool,
        donate: bool,
    ):
        self.loss_fn = loss_fn
        self.per_member_batch = per_member_batch
        self.has_aux = has_aux
        self.donate = donate
        self.make_optimizer: Callable[[], nnx.Optimizer] | None = None
        functools.update_wrapper(self, loss_fn, updated=())
        self._programs = ProgramCache()
        self._reads = OutsideValues("the train step")
        self._layouts: dict[Any, list[NamedSharding]] = {}  # see _program

    def init(self) -> nnx.Optimizer:
        """The per-member optimizer of a step made by ``ens.train_step(loss_fn, tx)``."""
        if self.make_optimizer is None:
            raise ValueError(
                "this step was made without an optimizer (nnx_train_step(loss_fn)); make one with "
                "ensemble.nnx_optimizer(ens, tx), or use ens.train_step(loss_fn, tx)."
            )
        return self.make_optimizer()

    def __call__(self, ens: NNXEnsemble, optimizer: nnx.Optimizer, *batch: Any) -> Any:
        """Updates ``ens`` and ``optimizer`` in place; returns per-member losses ``[n]``."""
        return self._run(ens, optimizer, batch, batch)

    def scan(
        self,
        ens: NNXEnsemble,
        optimizer: nnx.Optimizer,
        *batches: Any,
        stacked: bool | Sequence[bool] = True,
    ) -> Any:
        """K steps in one compiled call, the batches of the K steps stacked on a leading axis
        (per-member ones ``[K, n, ...]``; ``stacked=False`` for an argument that is the same at
        every step); returns losses ``[n, K]`` (aux ``[n, K, ...]``). As
        :meth:`TrainStep.scan <ensemble.TrainStep.scan>`: the numbers of K calls, one dispatch.

        Example:
          >>> import jax.numpy as jnp, optax, ensemble
          >>> from flax import nnx
          >>> ens = ensemble.build(lambda rngs: nnx.Linear(3, 1, rngs=rngs), n=4)
          >>> step = ens.train_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
          >>> step.scan(ens, step.init(), jnp.ones((10, 2, 3))).shape  # 10 steps
          (4, 10)
        """
        if any(isinstance(b, nnx.Rngs) for b in batches):  # before the stacked-axis checks
            raise TypeError(
                "step.scan takes no nnx.Rngs (its keys would be drawn once for all K steps); "
                "pass keys per step and member instead: jax.random.split(key, (K, n)), with "
                "per_member_batch True for that argument."
            )
        flags = stacked_flags(stacked, len(batches))
        return self._run(ens, optimizer, batches, one_step_of(batches, flags), flags)

    def _program(
        self,
        ens: NNXEnsemble,
        ens_def: Any,
        states: tuple[Any, Any],
        scan: bool,
        check: Callable[[], None],
    ) -> Any:
        """The jitted step (or K steps), its outputs pinned where the state is: unpinned, the
        compiler chose its own placement (a bias split over 'model' like the kernel before it,
        say), so the arrays moved, and every call met new input shardings and compiled again.
        Inside the caller's own jit the state is traced, and that jit's shardings apply.
        ``check`` runs before a program is made."""
        leaves, treedef = jax.tree.flatten(states)
        pinned = None
        if not any(isinstance(x, jax.core.Tracer) for x in leaves):
            # Kept by layout (shapes and shardings), as the linen step keeps its own: a step is
            # called again and again with the arrays of the last, and the pass over every
            # Variable that finds where each goes is then done once. One step serves any
            # ensemble: host arrays have no sharding, so the ensemble's own mesh is in the key.
            placed = tuple((np.shape(x), getattr(x, "sharding", None)) for x in leaves)
            layout = (treedef, ens.mesh, ens.n, ens.rules, placed)
            pinned = self._layouts.get(layout)
            if pinned is None:
                pinned = self._layouts[layout] = _kept_shardings(ens, states)
        outside = self._reads(self.loss_fn, *_classes(ens_def))
        key = (scan, treedef, None if pinned is None else tuple(pinned), outside)

        def make() -> Any:
            check()
            out = None if pinned is None else (None, *jax.tree.unflatten(treedef, pinned))
            step = self._steps if scan else self._step
            # A function of its own per program: JAX keeps traces by function, and a new value
            # read from outside (the key's last part) must trace anew.
            program = functools.wraps(step)(lambda *args, **kwargs: step(*args, **kwargs))
            return jax.jit(
                program,
                static_argnums=(0, 1),
                static_argnames="stacked" if scan else (),
                donate_argnums=(2, 3) if self.donate else (),
                out_shardings=out,
            )

        return self._programs.get_or_make(key, make)

    def _run(
        self,
        ens: Any,
        optimizer: Any,
        batch: tuple,
        one: tuple,
        stacked: tuple[bool, ...] | None = None,
    ) -> Any:
        _check_pair(ens, optimizer)
        axes = self._batch_axes(len(batch), ens.in_axes)
        rngs = [isinstance(b, nnx.Rngs) for b in batch]
        # An nnx.Rngs gives each member its own key per stream, as in a call of the ensemble
        # (drawn here, outside the jitted step: the caller's Rngs advances once).
        axes = tuple(None if r else a for r, a in zip(rngs, axes))
        one = tuple(None if r else b for r, b in zip(rngs, one))
        check_inputs(one, axes, ens.n, "batch argument", *BATCH_FIXES, mesh=ens.mesh)
        if stacked is not None:
            check_stacked_inputs(batch, stacked, axes, ens.n, BATCH_FIXES[1], ens.mesh)
        batch = tuple(_take_rngs(b, ens.mesh) if r else b for r, b in zip(rngs, batch))
        ens_def, ens_state = nnx.split(ens)
        opt_def, opt_state = nnx.split(optimizer)
        check_live((ens_state, opt_state), "ensemble or optimizer state ", _KEEP_A_COPY)
        check_member_major(ens_state, ens.n, "nnx.state(ens)", _MADE_AFTER_BUILD)
        check_on_mesh(ens_state, ens.mesh, "nnx.state(ens)", member_major=True)
        check_on_mesh(opt_state, ens.mesh, "nnx.state(optimizer)", member_major=True)
        donated = {"ensemble": ens_state, "optimizer": opt_state}
        check_not_donated(batch, donated, "ensemble / optimizer state", self.donate)
        defs = _Static(ens_def), _Static(opt_def)
        check = self._grouped_conv_check(ens, one, axes, rngs)
        program = self._program(ens, ens_def, (ens_state, opt_state), stacked is not None, check)
        if stacked is not None:
            program = functools.partial(program, stacked=stacked)
        with own_mesh(ens.mesh), explained_errors(), traced_batch(batch):
            out, new_ens, new_opt = program(*defs, ens_state, opt_state, batch)
        # The donated input buffers are gone; point the live modules at the new ones.
        nnx.update(ens, new_ens)
        nnx.update(optimizer, new_opt)
        return out

    def lower(
        self,
        ens: NNXEnsemble,
        optimizer: nnx.Optimizer,
        *batch: Any,
        stacked: bool | Sequence[bool] | None = None,
    ) -> Any:
        """``jax.stages.Lowered`` of the step, e.g. for ``.compile().memory_analysis()``; with
        ``stacked`` (as for :meth:`scan`), of :meth:`scan`."""
        _check_pair(ens, optimizer)
        ens_def, ens_state = nnx.split(ens)
        opt_def, opt_state = nnx.split(optimizer)
        defs = _Static(ens_def), _Static(opt_def)
        axes = self._batch_axes(len(batch), ens.in_axes)
        one = batch if stacked is None else one_step_of(batch, stacked_flags(stacked, len(batch)))
        rngs = [isinstance(b, nnx.Rngs) for b in one]
        check = self._grouped_conv_check(ens, one, axes, rngs)
        program = self._program(ens, ens_def, (ens_state, opt_state), stacked is not None, check)
        with own_mesh(ens.mesh):
            if stacked is None:
                return program.lower(*defs, ens_state, opt_state, batch)
            flags = stacked_flags(stacked, len(batch))
            return program.lower(*defs, ens_state, opt_state, batch, stacked=flags)

    def _grouped_conv_check(
        self, ens: NNXEnsemble, one: tuple, axes: tuple, rngs: Sequence[bool]
    ) -> Callable[[], None]:
        """Refuses, before a program is made, grouped convs that XLA gets wrong on the
        ensemble's mesh (made per call, run only before a compile). An ``nnx.Rngs`` argument
        (``rngs``) is traced as a fresh one, made inside the trace."""

        def check() -> None:
            member_def, members = nnx.split(ens.members)

            def loss(state: Any, *batch: Any) -> Any:
                batch = tuple(nnx.Rngs(0) if r else b for r, b in zip(rngs, batch))
                return self.loss_fn(nnx.merge(member_def, state), *batch)

            refuse_split_grouped_convs(loss, members, "ens.members", one, axes, ens.mesh)

        return check

    def _batch_axes(self, count: int, ens_in_axes: Any) -> tuple[int | None, ...]:
        pmb = self.per_member_batch
        if pmb is None:  # not given: the ensemble's own in_axes decide
            pmb = batch_default(ens_in_axes)
        if isinstance(pmb, tuple):
            return arg_axes(tuple(0 if b else None for b in pmb), count)
        return arg_axes(0 if pmb else None, count)

    def _step(self, ens_def, opt_def, ens_state, opt_state, batch, batched=None):
        ens = nnx.merge(ens_def.value, ens_state)
        optimizer = nnx.merge(opt_def.value, opt_state)
        in_axes = self._batch_axes(len(batch), ens.in_axes)
        # Loss and gradient run inside each member (no gradient flows across members, and no
        # cross-member sum is ever formed); the per-member optax update follows.
        # The user's filter, on a member's own paths (squeezed: see Members._device_program).
        grads_of = _member_grads(self, _member_filter(optimizer.wrt))
        losses, aux, grads = ens._map(grads_of, batch, {}, in_axes, True, batched)
        # value=: each member's loss, for optax transforms that read it (reduce_on_plateau).
        try:
            optimizer.update(ens, nnx.State({"members": grads}), value=losses)
        except TypeError as e:
            if "keyword-only argument" not in str(e):
                raise
            raise TypeError(
                f"the optimizer's update needs arguments this step does not pass ({e}): the NNX "
                "train step passes value= (each member's loss) only. Transforms that also need "
                "grad= and value_fn= (optax.lbfgs's line search) work with ensemble.train_step "
                "on a linen model, or with a plain step size (optax.lbfgs(linesearch=None))."
            ) from None
        out = (losses, aux) if self.has_aux else losses
        return out, nnx.state(ens), nnx.state(optimizer)

    def _steps(self, ens_def, opt_def, ens_state, opt_state, batches, *, stacked):
        def one(carry, batch):
            # Arguments passed once (a dataset the steps index into) are no batch of rows.
            out, ens_state, opt_state = self._step(ens_def, opt_def, *carry, batch, stacked)
            return (ens_state, opt_state), out

        carry = (ens_state, opt_state)
        (ens_state, opt_state), out = scan_steps(one, carry, batches, stacked)
        return out, ens_state, opt_state


def _kept_shardings(ens: NNXEnsemble, states: Any) -> list[NamedSharding]:
    """Per state leaf, where the step keeps it (``kept_sharding``); a leaf that is not placed on
    the member axis (host arrays put back with ``nnx.update``, a replicated copy) goes where the
    ensemble places it, its annotation's split included (on the member axis alone, a kernel
    split over 'model' stayed whole on each of a member's devices from then on)."""
    variables = jax.tree_util.tree_leaves_with_path(states, is_leaf=_is_variable)
    rules = _with_mesh_axes(ens.rules, ens.mesh)
    # As in nnx_optimizer: an optimizer's moment takes the names of a parameter of its shape.
    params = jax.tree.leaves(nnx.state(ens), is_leaf=_is_variable)
    named = {(np.shape(v.get_value()), _names(v)) for v in params if isinstance(v, nnx.Variable)}

    def kept(path: Any, v: Any) -> NamedSharding:
        x = v.get_value() if isinstance(v, nnx.Variable) else v
        names = _names(v) if isinstance(v, nnx.Variable) else None
        names = names if (np.shape(x), names) in named else None
        own = lambda: _leaf_sharding(path, np.shape(x), names, ens.mesh, ens.n, rules)
        return kept_sharding(x, ens.mesh, ens.n, ens.rules, own)

    pinned = [kept(path, v) for path, v in variables]
    leaves = jax.tree.leaves(states)
    if len(pinned) != len(leaves):  # a Variable of several arrays: each where it is
        return [kept_sharding(x, ens.mesh, ens.n, ens.rules) for x in leaves]
    return pinned


def _kept(new: Any, old: Any, sharding: NamedSharding) -> Any:
    """A Variable's value after the call: None where the call left it, else pinned where it was
    (a value of another shape, a cache set to a scalar, goes where the compiler puts it)."""
    if new is old:
        return None
    if np.shape(new) != np.shape(old):
        return new
    return jax.lax.with_sharding_constraint(new, sharding)


def _placement(x: Any) -> Any:
    """Where ``x`` is, for a cache key: a spec's trailing ``None`` (meaning the same) dropped;
    the compiler writes ``P('ensemble', 'model')`` for the ``P('ensemble', 'model', None)`` it
    was given."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return sharding.mesh, spec, sharding.memory_kind


class _Static:
    """A graphdef as a static argument of ``jax.jit``: modules keep attributes as given, and a
    list one (``nnx.Conv(..., strides=[1, 1])``) made the graphdef unhashable, which jit refused
    in a dump of the whole graphdef. Such graphdefs share one hash; equality tells them apart."""

    def __init__(self, value: Any):
        self.value = value
        try:
            self._hash = hash(value)
        except TypeError:
            self._hash = hash(type(value))
        # Now, not at the first comparison: an attribute mutated in place (a config's field)
        # is the same object in both graphdefs, and only this snapshot tells them apart.
        self._typed = repr(value), _typed_attributes(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static):
            return False
        try:  # by the attributes' types too: == says an attribute of 1, 1.0 and True (or
            # -0.0 and 0.0) are the same, repr that 1 and bfloat16(1) are, and a program
            # traced with one gave another's dtype (or sign)
            return bool(self.value == other.value) and self._typed == other._typed
        except Exception:  # an attribute whose == is no bool (a NumPy array): only itself
            return self.value is other.value


def _typed_attributes(graphdef: Any) -> Any:
    """A graphdef's static attributes with the type of every part (:func:`typed`)."""
    attributes = getattr(graphdef, "attributes", None)
    if not isinstance(attributes, list):
        return None
    return tuple((k, type(a), typed(getattr(a, "value", None))) for k, a in attributes)


def _member_grads(step: NNXTrainStep, wrt: Any) -> Callable[..., Any]:
    def grads_of(member: nnx.Module, *batch: Any) -> Any:
        def loss_of(m: nnx.Module, *batch: Any) -> Any:
            return split_loss(step.loss_fn(m, *batch), step.has_aux)

        # The batch goes in as arguments, not a closure: an nnx.Rngs in it is then the
        # transform's to advance (a closed-over one is of another trace level).
        grad_fn = nnx.value_and_grad(loss_of, argnums=nnx.DiffState(0, wrt), has_aux=True)
        (loss, aux), grads = grad_fn(member, *batch)
        return loss, aux, grads

    return grads_of


@dataclasses.dataclass(frozen=True)
class _InMembers:
    """A ``wrt`` filter written for one member (as for the plain model: ``path[0] == 'head'``),
    applied to the ensemble's paths (``('members', 'head', ...)``) by the optimizer: its
    ``opt.wrt``; ``opt.wrt.filter`` is the filter as given."""

    filter: Any

    def __call__(self, path: tuple, value: Any) -> bool:
        inside = path[:1] == ("members",)
        return inside and nnx.filterlib.to_predicate(self.filter)(path[1:], value)


def _in_members_tx(tx: optax.GradientTransformationExtraArgs) -> Any:
    """``tx`` on the ensemble's state as on one member's: ``nnx.Optimizer`` hands it the tree
    under the ensemble's ``'members'`` (``{'members': {'head': ...}}``, all of it there, by
    :class:`_InMembers`); ``tx`` gets what is inside, as the plain model's optimizer does, and
    its updates go back under ``'members'``. A label function written for the plain model
    (``path[0] == 'backbone'``) saw ``'members'`` first and silently sent every parameter to
    another transform (a frozen backbone trained)."""

    def inside(tree: Any) -> Any:
        return None if tree is None else tree["members"]

    def init_fn(params: Any) -> Any:
        return tx.init(inside(params))

    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        new, state = tx.update(inside(updates), state, inside(params), **extra)
        # Leaf for leaf in the same order (all of them are under 'members'), in the given tree.
        return jax.tree.unflatten(jax.tree.structure(updates), jax.tree.leaves(new)), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _member_filter(wrt: Any) -> Any:
    return wrt.filter if isinstance(wrt, _InMembers) else wrt


def _check_pair(ens: Any, optimizer: Any) -> None:
    if not isinstance(ens, NNXEnsemble):
        raise TypeError(f"expected an NNXEnsemble first, got {type(ens).__name__}.")
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"expected an nnx.Optimizer second (from ensemble.nnx_optimizer), got "
            f"{type(optimizer).__name__}."
        )
    update = getattr(getattr(optimizer, "tx", None), "update", None)
    if getattr(update, "__code__", None) not in _PER_MEMBER:
        # Its tx would see all members at once: clip_by_global_norm clipped each member by
        # the norm over every member, silently.
        raise ValueError(
            "this nnx.Optimizer was not made with ensemble.nnx_optimizer: its optax "
            "transformation sees every member at once (clip_by_global_norm would clip each "
            "member by the norm over all of them; Adam would keep no state per member). Make it "
            "with ensemble.nnx_optimizer(ens, tx) or step.init() of ens.train_step(loss_fn, tx)."
        )
    # An optimizer made for an ensemble of another n otherwise fails deep in optax's update,
    # naming the value= argument that the step passes, not the optimizer.
    check_member_major(
        nnx.state(optimizer).get("opt_state", {}),  # none for a stateless tx (sgd)
        ens.n,
        "optimizer state leaf opt_state",
        "The optimizer was made for another ensemble: make it for this one, with "
        "ensemble.nnx_optimizer(ens, tx) or step.init() of ens.train_step(loss_fn, tx).",
    )


#: The updates of every per-member optax transformation, that of nnx_optimizer and
#: per_member's own (how an optimizer of either is told from a plain nnx.Optimizer).
_PER_MEMBER = (
    _in_members_tx(per_member(optax.identity(), 1)).update.__code__,
    per_member(optax.identity(), 1).update.__code__,
)


def nnx_train_step(
    loss_fn: Callable[..., Any],
    *,
    per_member_batch: bool | Sequence[bool] | None = None,
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
        ``False``: one batch shared by all members. A sequence of bools decides per batch
        argument (e.g. ``(True, False)``: per-member inputs, shared targets). Default: the
        ensemble's ``in_axes`` (``0``: per-member, ``None``: shared; a tuple needs it given).
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
    elif per_member_batch is not None:
        per_member_batch = bool(per_member_batch)
    return NNXTrainStep(loss_fn, per_member_batch, bool(has_aux), bool(donate))
