"""A donated, jitted train step for an ensemble: per-member loss, per-member optax state.

``loss_fn(member_params, *batch)`` is the plain loss of ONE member (it may call the plain model's
``model.apply({'params': p}, x)``); the whole member update (loss, gradient, ``tx``, new
parameters) runs once per member through the member runner (``ensemble._core``), so
``optax.clip_by_global_norm`` sees one member's gradient at a time and nothing crosses members.
Parameters and optimizer state stay exactly where they were (outputs have the inputs'
shardings, inputs are donated).

BatchNorm (and any state a loss updates): pass the member-major ``batch_stats`` as a per-member
batch argument and return the new ones as aux::

    def loss_fn(params, batch_stats, x, y):
        logits, upd = model.apply({'params': params, 'batch_stats': batch_stats}, x,
                                  train=True, mutable=['batch_stats'])
        return optax.softmax_cross_entropy(logits, y).mean(), upd['batch_stats']

    step = train_step(loss_fn, optax.adam(1e-3), n=ens.n, mesh=ens.mesh, has_aux=True,
                      per_member_batch=(True, False, False))
    params, opt_state, losses, batch_stats = step(params, opt_state, batch_stats, x, y)
    # K steps in one call, each step's new statistics passed to the next (xs, ys: [K, ...]):
    params, opt_state, losses, batch_stats = step.scan(params, opt_state, batch_stats, xs, ys,
                                                       carry=0)

Dropout: pass ``jax.random.split(key, n)`` as a per-member batch argument and use it as the
member's ``rngs={'dropout': k}``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from ensemble._core import (
    BATCH_FIXES,
    Members,
    ProgramCache,
    check_inputs,
    check_live,
    check_member_major,
    check_not_donated,
    check_on_mesh,
    check_stacked_inputs,
    explained_errors,
    split_loss,
)
from ensemble._grouped_convs import refuse_split_grouped_convs
from ensemble._mesh import (
    MODEL_AXIS,
    as_if_outside_meshes,
    check_mesh,
    kept_sharding,
    member_sharding,
    merge_rules,
    own_mesh,
)
from ensemble._optim import accepted_extra_args, as_transformation, per_member, state_shardings
from ensemble._outside import OutsideValues
from ensemble._steps import one_step_of, scan_steps, stacked_flags, traced_batch
from ensemble._warn import warn_user


class TrainStep:
    """A jitted ensemble train step; see :func:`train_step`.

    ``step(params, opt_state, *batch) -> (params, opt_state, losses[n])`` (``+ (aux,)`` with
    ``has_aux``); ``step.init(params)`` makes the per-member optimizer state on the member axis;
    ``step.scan(params, opt_state, *batches)`` runs K steps in one call (batches stacked on a
    leading axis of K); ``step.tx`` is the per-member optax transformation; ``step.lower(...)``
    gives the lowered program (``.compile().memory_analysis()`` shows per-device bytes and
    donated aliases).

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, ensemble
      >>> model = nn.Dense(1)
      >>> ens = ensemble.build(model, n=8)
      >>> params = ens.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
      >>> step = ens.train_step(lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2),
      ...                       optax.adam(1e-2), per_member_batch=True)
      >>> new, opt_state, losses = step(params, step.init(params), jnp.ones((8, 4, 3)))
      >>> params["kernel"].is_deleted(), new["kernel"].sharding.spec  # donated; stays put
      (True, P('ensemble', None, None))
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        tx: optax.GradientTransformation,
        members: Members,
        *,
        per_member_batch: bool | Sequence[bool] = False,
        has_aux: bool = False,
        donate: bool = True,
        hyperparams: Mapping[str, Sequence[float] | jax.Array] | None = None,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        tx = as_transformation(tx)
        self._loss_fn = loss_fn
        self._members = members
        self._member_tx = tx
        self._tx = per_member(tx, members.n, **dict(hyperparams or {}))
        self._per_member_batch = per_member_batch
        self._has_aux = bool(has_aux)
        self._donate = bool(donate)
        self._cache = ProgramCache()
        self._reads = OutsideValues("the train step")
        self._layouts: dict[Hashable, tuple[Any, Any, Hashable]] = {}  # see _state_shardings

    @classmethod
    def for_members(
        cls, loss_fn: Callable[..., Any], tx: optax.GradientTransformation, members: Members, **kw
    ) -> TrainStep:
        """The step for an ensemble's member runner (``ens.train_step`` calls this)."""
        return cls(loss_fn, tx, members, **kw)

    @property
    def tx(self) -> optax.GradientTransformation:
        """The per-member transformation (``ensemble.per_member(tx, n, **hyperparams)``)."""
        return self._tx

    @property
    def n(self) -> int:
        """The number of members (the length of every member-major leading axis)."""
        return self._members.n

    @property
    def mesh(self) -> Mesh:
        """The ensemble's ``('ensemble', 'data', 'model')`` mesh the step runs on."""
        return self._members.mesh

    # ------------------------------------------------------------------ optimizer state

    def init(self, params: Any) -> Any:
        """Per-member optimizer state, initialised straight onto the member axis.

        Parameter-shaped parts of the state (Adam moments, ...) get the parameters' shardings;
        everything else (step counts, injected hyperparameters) is ``[n]`` on the member axis.
        """
        self._check_member_major(params, "params")
        check_live(params, "params")
        with as_if_outside_meshes(self.mesh):
            return jax.jit(self._tx.init, out_shardings=self._opt_shardings(params))(params)

    def _opt_shardings(self, params: Any) -> Any:
        abstract = jax.eval_shape(self._tx.init, params)
        rules = self._members.rules

        def default(x: Any) -> Any:  # only the member axis; empty nodes (optax.MaskedNode) kept
            return member_sharding(self.mesh, len(x.shape), None, rules) if _shaped(x) else x

        param_shardings = jax.tree.map(self._sharding_of, params)
        try:
            return state_shardings(self._member_tx, abstract, params, param_shardings, default)
        except Exception as e:  # an exotic state layout: the member axis only
            if self.mesh.shape[MODEL_AXIS] > 1:
                warn_user(
                    f"train_step: the optimizer state's layout is not one optax can map onto "
                    f"the parameters ({type(e).__name__}: {e}), so its moments are split over "
                    "the members only, not over the 'model' devices like the parameters: each "
                    "of a member's devices holds them whole.",
                )
            return jax.tree.map(default, abstract)

    # ------------------------------------------------------------------ the step

    def __call__(self, params: Any, opt_state: Any, *batch: Any) -> tuple[Any, ...]:
        """One step of every member: ``(params, opt_state, losses[n])``, ``+ (aux,)`` with
        ``has_aux``.

        ``params`` and ``opt_state`` are donated (with ``donate=True``): keep only the returned
        ones. The program is compiled once per structure and sharding of the inputs. They come
        back where they are; leaves not split on the member axis (host arrays, a replicated
        copy) come back on the member axis alone, as the step cannot know the model's own
        splits: place such params first (``jax.device_put(params, ens.init_shardings(key,
        x)["params"])``) where the model splits them inside members (over ``'model'``).
        """
        with own_mesh(self.mesh), explained_errors(), traced_batch(batch):
            return self._program(params, opt_state, batch)(params, opt_state, *batch)

    def scan(
        self,
        params: Any,
        opt_state: Any,
        *batches: Any,
        stacked: bool | Sequence[bool] = True,
        carry: int | None = None,
    ) -> tuple[Any, ...]:
        """K steps in one compiled call, the batches of the K steps stacked on a leading axis.

        Stacked per-member arguments are ``[K, n, ...]``, stacked shared ones ``[K, ...]``;
        ``stacked`` (one flag per batch argument, or one for all) marks those that are the same
        at every step instead (a dataset the steps index into), passed once. Returns what K
        calls of the step would, with losses ``[n, K]`` (and aux ``[n, K, ...]``): the same
        numbers, but the dispatch (which costs more than a small step, and more on a mesh of
        several devices) is paid once.

        ``carry=i`` (with ``has_aux``): state the loss updates, such as BatchNorm's
        ``batch_stats``, goes from step to step: batch argument ``i`` (passed once, member-major)
        is the first step's, each step's aux is the next step's, and the last aux comes back in
        its place, ``(params, opt_state, losses, state)``: what K calls passing each call's aux
        to the next would give.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, ensemble
          >>> model = nn.Dense(1)
          >>> ens = ensemble.build(model, n=4)
          >>> params = ens.init(jax.random.key(0), jnp.ones((2, 3)))["params"]
          >>> def loss_fn(p, idx, x):  # the rows idx of a dataset x
          ...     return jnp.mean(model.apply({"params": p}, x[idx]) ** 2)
          >>> step = ensemble.train_step(loss_fn, optax.sgd(0.1), n=4, mesh=ens.mesh)
          >>> idx = jnp.arange(20).reshape(10, 2) % 5  # 10 steps of 2 rows
          >>> x = jnp.ones((5, 3))
          >>> out = step.scan(params, step.init(params), idx, x, stacked=(True, False))
          >>> out[2].shape  # losses: member, step
          (4, 10)
        """
        flags = stacked_flags(stacked, len(batches))
        if carry is not None:
            flags = self._carried(carry, flags)
            self._check_carry_layout(carry, batches[carry])
        with own_mesh(self.mesh), explained_errors(), traced_batch(batches):
            program = self._program(params, opt_state, batches, flags, carry)
            return program(params, opt_state, *batches)

    def _check_carry_layout(self, carry: int, state: Any) -> None:
        """The carried argument is the first step's state, ``[n, ...]``: one stacked per step
        (``[K, n, ...]``) is refused saying so (the batch check's advice would not fit)."""
        for path, leaf in jax.tree_util.tree_leaves_with_path(state):
            shape = np.shape(leaf)
            if not shape or shape[0] != self.n:
                raise ValueError(
                    f"scan(carry={carry}): batch argument {carry} is the first step's state, "
                    f"passed once with a leading member axis of n={self.n} (not stacked per "
                    f"step); its leaf {jax.tree_util.keystr(path)} has shape {shape}."
                )

    def _carried(self, carry: Any, flags: tuple[bool, ...]) -> tuple[bool, ...]:
        """``flags`` with the carried argument passed once; a ``carry`` that cannot be, refused."""
        count = len(flags)
        if isinstance(carry, bool) or not isinstance(carry, int) or not 0 <= carry < count:
            raise ValueError(
                f"carry={carry!r} names the batch argument that each step's aux replaces: an "
                f"index in [0, {count})."
            )
        if not self._has_aux:
            raise ValueError(
                "carry= needs a loss that returns (loss, new state): build the step with "
                "has_aux=True."
            )
        if self._batch_axes(count)[carry] is None:
            raise ValueError(
                f"carry={carry}: batch argument {carry} is shared by the members, but state a "
                "member's loss updates is its own: mark it per member (per_member_batch)."
            )
        return tuple(False if i == carry else f for i, f in enumerate(flags))

    def lower(
        self,
        params: Any,
        opt_state: Any,
        *batch: Any,
        stacked: bool | Sequence[bool] | None = None,
        carry: int | None = None,
    ) -> jax.stages.Lowered:
        """The lowered step, e.g. ``step.lower(p, s, x).compile().memory_analysis()``; with
        ``stacked`` (and ``carry``, as for :meth:`scan`), the lowered :meth:`scan`."""
        if carry is not None and stacked is None:
            stacked = True
        flags = None if stacked is None else stacked_flags(stacked, len(batch))
        if carry is not None:
            flags = self._carried(carry, flags)
        # Shape structs without a sharding stand for the state where the step keeps it (on the
        # member axis): lowered as unplaced inputs instead, the step lost its donation and
        # compiled_memory over-reported its peak (by a third for a small MLP).
        params, opt_state = jax.tree.map(self._placed_spec, (params, opt_state))
        with own_mesh(self.mesh), traced_batch(batch):
            program = self._program(params, opt_state, batch, flags, carry)
            return program.lower(params, opt_state, *batch)

    def _placed_spec(self, x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._sharding_of(x))
        return x

    def _batch_axes(self, count: int) -> tuple[int | None, ...]:
        pmb = self._per_member_batch
        if isinstance(pmb, bool):
            return (0 if pmb else None,) * count
        pmb = tuple(pmb)
        if len(pmb) != count:
            raise ValueError(
                f"per_member_batch={pmb} gives one flag per batch argument, but {count} batch "
                "argument(s) were passed."
            )
        return tuple(0 if b else None for b in pmb)

    def _program(
        self,
        params: Any,
        opt_state: Any,
        batch: tuple[Any, ...],
        stacked: tuple[bool, ...] | None = None,
        carry: int | None = None,
    ) -> Callable[..., Any]:
        """The jitted step for these inputs (``stacked``: the :meth:`scan` of that layout;
        ``carry``: its carried argument)."""
        if isinstance(params, optax.LookaheadParams):
            raise ValueError(
                "params are optax.LookaheadParams: this step differentiates the loss with "
                "respect to all of params, while optax.lookahead wants the gradient of the fast "
                "ones only. Write the step yourself (gradient of params.fast, then "
                "ensemble.per_member(tx, n).update), or use another optimizer."
            )
        check_live(params, "params")
        check_live(opt_state, "opt_state")
        axes = self._batch_axes(len(batch))
        one = batch if stacked is None else one_step_of(batch, stacked)
        check_inputs(one, axes, self.n, "batch argument", *BATCH_FIXES, mesh=self.mesh)
        if stacked is not None:
            check_stacked_inputs(batch, stacked, axes, self.n, BATCH_FIXES[1], self.mesh)
        donated = {"params": params, "opt_state": opt_state}
        check_not_donated(batch, donated, "params / opt_state", self._donate)
        p_sh, s_sh, state_key = self._state_shardings(params, opt_state)
        key = (state_key, axes, stacked, carry, self._reads(self._loss_fn))

        def make() -> Callable[..., Any]:
            refuse_split_grouped_convs(self._loss_fn, params, "params", one, axes, self.mesh)
            return self._compile(axes, p_sh, s_sh, stacked, carry)

        return self._cache.get_or_make(key, make)

    def _state_shardings(self, params: Any, opt_state: Any) -> tuple[Any, Any, Hashable]:
        """The state's shardings in and out, its layout checked, and its part of the program
        key (structure and shardings); kept by layout (shapes and shardings): a step is called
        again and again with the arrays of the last, and these passes over every leaf cost
        about 5 us a leaf (8 ms a call for 1,500 leaves)."""
        leaves, treedef = jax.tree.flatten((params, opt_state))
        layout = None
        if not any(isinstance(x, jax.core.Tracer) for x in leaves):
            layout = (treedef, tuple((np.shape(x), getattr(x, "sharding", None)) for x in leaves))
            if layout in self._layouts:
                return self._layouts[layout]
        self._check_member_major(params, "params")
        self._check_member_major(opt_state, "opt_state")
        self._check_opt_structure(params, opt_state)
        check_on_mesh(params, self.mesh, "params", member_major=True)
        check_on_mesh(opt_state, self.mesh, "opt_state", member_major=True)
        p_sh = jax.tree.map(self._sharding_of, params)
        s_sh = jax.tree.map(self._sharding_of, opt_state)
        found = (p_sh, s_sh, (treedef, tuple(jax.tree.leaves((p_sh, s_sh)))))
        if layout is not None:
            self._layouts[layout] = found
        return found

    def _compile(
        self,
        axes: tuple[int | None, ...],
        p_sh: Any,
        s_sh: Any,
        stacked: tuple[bool, ...] | None,
        carry: int | None = None,
    ) -> Callable[..., Any]:
        members, has_aux = self._members, self._has_aux
        member_grads = _member_grads(self._loss_fn, has_aux)
        member_update = _member_update(self._loss_fn, self._member_tx, has_aux)

        def step(params, opt_state, *batch):
            # Two member calls in one program: the gradient (fresh outputs: squeezed, see
            # Members._device_program), then the optimizer, which overwrites the donated state.
            # A scan's arguments passed once (a dataset the steps index into, the carried
            # state) are no batch of rows to split over a member's devices.
            batched = tuple(stacked) if stacked is not None else (True,) * len(batch)
            loss, aux, grads = members.map(
                member_grads, (params, *batch), (0, *axes), batched=(False, *batched), squeeze=True
            )
            params, opt_state = members.map(
                member_update,
                (params, opt_state, grads, loss, *batch),
                (0, 0, 0, 0, *axes),
                batched=(False, False, False, False, *batched),
            )
            return (params, opt_state, loss, aux) if has_aux else (params, opt_state, loss)

        def one(state, batch):
            out = step(*state, *batch)
            return out[:2], out[2:]  # (params, opt_state), (losses[, aux])

        def one_carrying(state, batch):
            params, opt_state, carried = state
            batch = (*batch[:carry], carried, *batch[carry + 1 :])
            params, opt_state, loss, aux = step(params, opt_state, *batch)
            _check_carried(carry, carried, aux)
            return (params, opt_state, aux), loss

        def steps(params, opt_state, *batches):
            if carry is None:
                (params, opt_state), rest = scan_steps(one, (params, opt_state), batches, stacked)
                return (params, opt_state, *rest)
            state = (params, opt_state, batches[carry])
            (params, opt_state, carried), losses = scan_steps(one_carrying, state, batches, stacked)
            return params, opt_state, losses, carried

        scan = stacked is not None
        loss_sharding = member_sharding(self.mesh, 1 + scan, None, members.rules)
        out_shardings: tuple[Any, ...] = (p_sh, s_sh, loss_sharding)
        if has_aux:
            out_shardings = (*out_shardings, None)
        return jax.jit(
            steps if scan else step,
            out_shardings=out_shardings,
            donate_argnums=(0, 1) if self._donate else (),
        )

    def _sharding_of(self, x: Any) -> NamedSharding:
        return kept_sharding(x, self.mesh, self.n, self._members.rules)

    def _check_opt_structure(self, params: Any, opt_state: Any) -> None:
        """Another optimizer's state, or params and opt_state swapped, failed deep in optax or
        in jax.grad (an AttributeError on 'mu', grad of an int32 count), naming neither."""
        want = jax.tree.structure(jax.eval_shape(self._tx.init, params))
        got = jax.tree.structure(opt_state)
        if got != want:
            raise TypeError(
                f"opt_state is not this step's optimizer state for these params (a tree of "
                f"{got.num_leaves} leaves, {type(opt_state).__name__} at the top, where "
                f"step.init(params) gives {want.num_leaves} leaves, "
                f"{type(jax.tree.unflatten(want, [0] * want.num_leaves)).__name__} at the top): "
                "pass step.init(params) of this same step, as step(params, opt_state, *batch)"
            )

    def _check_member_major(self, tree: Any, what: str) -> None:
        hint = "Pass the ensemble's variables['params'] and step.init(params)."
        check_member_major(tree, self.n, f"{what} leaf ", hint)


def _shaped(x: Any) -> bool:
    return hasattr(x, "shape")


def _member_loss(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    def member_loss(params, *batch):
        out = loss_fn(params, *batch)
        split_loss(out, has_aux)  # checked: a scalar loss, (loss, aux) with has_aux
        return out

    return member_loss


def _member_grads(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """One member's ``(loss, aux, gradient)``."""
    member_loss = _member_loss(loss_fn, has_aux)

    def grads(params, *batch):
        out, grads = jax.value_and_grad(member_loss, has_aux=has_aux)(params, *batch)
        loss, aux = out if has_aux else (out, None)
        return loss, aux, grads

    return grads


def _member_update(
    loss_fn: Callable[..., Any], tx: optax.GradientTransformation, has_aux: bool
) -> Callable[..., Any]:
    """One member's ``tx`` update (one member's state) and new parameters."""
    member_loss = _member_loss(loss_fn, has_aux)
    member_tx = optax.with_extra_args_support(tx)

    def update(params, opt_state, grads, loss, *batch):
        # optax's extra arguments, for the transforms that read them (reduce_on_plateau,
        # polyak_sgd: value; lbfgs: value, grad, value_fn); the others ignore them.
        value_fn = lambda p: member_loss(p, *batch)[0] if has_aux else member_loss(p, *batch)
        extra = dict(value=loss, grad=grads, value_fn=value_fn)
        updates, opt_state = member_tx.update(
            grads, opt_state, params, **accepted_extra_args(member_tx, extra)
        )
        return optax.apply_updates(params, updates), opt_state

    return update


def _check_carried(index: int, carried: Any, aux: Any) -> None:
    """A carried argument and the aux that replaces it must be alike, leaf for leaf."""
    spec = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
    if jax.tree.structure(carried) != jax.tree.structure(aux) or spec(carried) != spec(aux):
        raise ValueError(
            f"scan(carry={index}): each step's aux replaces batch argument {index}, so it must "
            f"be alike leaf for leaf (structure, shapes, dtypes): aux {spec(aux)}, argument "
            f"{spec(carried)}."
        )


def train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    *,
    n: int,
    mesh: Mesh,
    rules: Sequence[tuple[str, Any]] | None = None,
    per_member_batch: bool | Sequence[bool] = False,
    has_aux: bool = False,
    donate: bool = True,
    hyperparams: Mapping[str, Sequence[float] | jax.Array] | None = None,
    data_parallel: bool = True,
    axis_name: str | None = None,
) -> TrainStep:
    """A donated, jitted train step for an n-member ensemble.

    Args:
      loss_fn: ``loss_fn(member_params, *batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``),
        the plain loss of ONE member.
      tx: the optax transformation of ONE member (e.g. ``optax.chain(clip_by_global_norm(1),
        adam(1e-3))``); it is wrapped with :func:`ensemble.per_member`, so every member has its
        own state and global transforms see one member at a time. Do not pre-wrap it.
      n: number of members.
      mesh: the ensemble's mesh (``ens.mesh``).
      rules: logical axis rules for constraints inside the loss (``ens.rules``).
      per_member_batch: ``False``: every batch argument is shared by all members; ``True``: every
        batch argument has a leading member axis n (bootstrapped batches, per-member keys); or one
        flag per batch argument.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux comes back member-major.
      donate: donate params and optimizer state: their buffers are reused for the outputs, so
        the arrays passed in (and any dict still holding them, e.g. the ``variables`` that
        ``params`` came from) are deleted after the call; keep only the returned ones.
      hyperparams: per-member values (length n) for hyperparameters of a ``tx`` made with
        ``optax.inject_hyperparams``, e.g. ``{'learning_rate': [1e-3, 3e-4, ...]}``.
      data_parallel: split a batch over the ``'data'`` axis when a member spans several devices.
      axis_name: name bound inside each member to its data-parallel axis, for a loss whose model
        was written for ``pmap`` (``BatchNorm(axis_name='batch')``). ``ens.train_step`` passes
        the ensemble's own.

    Returns:
      A :class:`TrainStep`: ``step(params, opt_state, *batch) -> (params, opt_state, losses)``
      (``+ (aux,)``), losses of shape ``[n]``; ``step.init(params)`` makes ``opt_state``.

    BatchNorm (state the loss updates): pass the member-major ``batch_stats`` as a per-member
    batch argument, return ``(loss, new_batch_stats)`` with ``has_aux=True``, and pass the
    returned ones to the next call (or ``step.scan(..., carry=i)``, which does so for K
    steps in one call). Dropout: a per-member batch argument ``jax.random.split(key, n)``,
    used as the member's ``rngs={'dropout': k}``, a new key each step. Both as code: the
    module docstring of ``ensemble._train``, and the README.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, ensemble
      >>> model = nn.Dense(1)
      >>> ens = ensemble.build(model, n=8)
      >>> params = ens.init(jax.random.key(0), jnp.ones((4, 3)))["params"]
      >>> def loss_fn(p, x, y):
      ...     return jnp.mean((model.apply({"params": p}, x) - y) ** 2)
      >>> step = train_step(loss_fn, optax.sgd(0.1), n=ens.n, mesh=ens.mesh)
      >>> opt_state = step.init(params)
      >>> params, opt_state, losses = step(params, opt_state, jnp.ones((4, 3)), jnp.zeros((4, 1)))
      >>> losses.shape
      (8,)
    """
    check_mesh(mesh, n)
    members = Members(int(n), mesh, merge_rules(rules), axis_name, bool(data_parallel))
    return TrainStep(
        loss_fn,
        tx,
        members,
        per_member_batch=per_member_batch,
        has_aux=has_aux,
        donate=donate,
        hyperparams=hyperparams,
    )
