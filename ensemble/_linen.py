"""Linen ensembles: n members of one ``nn.Module``, member-major variables sharded over a mesh.

A thin adapter over :class:`ensemble._core.Members`: each member is the plain ``model.init`` /
``model.apply`` on its own slice of the variables, run with a manual member axis. Consequences a
user can rely on:

- ``variables`` have exactly the plain model's tree, every leaf with a leading axis of size n.
- Member i of ``ens.apply(variables, x, rngs={'dropout': k})`` equals
  ``model.apply(ens.member(variables, i), x, rngs={'dropout': jax.random.split(k, n)[i]})``;
  the same holds for ``init`` with every rng stream (a stream named in ``shared_rngs`` is not split:
  every member gets the key itself).
- Keyword arguments to ``init``/``apply`` (``train=True``, ...) are shared by all members.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ensemble._core import (
    INPUT_FIXES,
    InAxes,
    Members,
    ProgramCache,
    abstract_signature,
    arg_axes,
    batch_default,
    check_in_axes,
    check_inputs,
    check_live,
    check_member_major,
    check_on_mesh,
    check_shared_kwargs,
    explained_errors,
    join_static,
    split_static,
    stream_keys,
)
from ensemble._mesh import (
    MEMBER_AXIS,
    MODEL_AXIS,
    LogicalRules,
    as_if_outside_meshes,
    check_split,
    devices_per_member,
    member_index,
    member_pspec,
    merge_rules,
    resolve_mesh,
    take_member,
    unmapped_names,
)
from ensemble._outside import OutsideValues
from ensemble._warn import warn_user

if TYPE_CHECKING:
    from ensemble._train import TrainStep

RngLike = Any  # a key (typed or legacy), an int seed, or a dict of them per rng stream


class LinenEnsemble:
    """An n-member ensemble of a linen module, every member's variables on its own device(s).

    Build it with :func:`ensemble.build`. ``init`` places every leaf (annotated or not, every
    collection) on the member axis straight from a jitted, ``out_shardings``-constrained init, so
    no device ever holds more than its share. ``apply`` is jitted once per static configuration
    (the Python values in its inputs, and those its code reads from outside them, such as a
    global or a closure's: a changed one compiles anew).

    Args:
      model: the plain linen module (an instance).
      n: number of members.
      mesh: a mesh from :func:`ensemble.sharding.make_mesh` (default: made from ``devices``).
      devices: devices for the default mesh (default: all).
      model_parallel: devices per member for tensor parallelism (needs rules onto ``'model'``).
      rules: logical axis rules, merged over :data:`ensemble.sharding.DEFAULT_RULES`.
      in_axes: ``None`` (inputs shared by all members), ``0`` (per-member inputs with a leading
        axis of size n), or one of those per positional argument.
      shared_rngs: rng streams that are *not* split per member (e.g. ``('noise',)``).
      data_parallel: when a member spans several devices on the ``'data'`` axis, split the leading
        (batch) axis of inputs over them. A hint only: results do not change.
      axis_name: name bound inside each member to its data-parallel axis, for models written for
        ``pmap`` (``nn.BatchNorm(axis_name='batch')``): statistics are over the member's batch.

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
        axis_name: str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"LinenEnsemble needs a linen nn.Module instance, got {type(model).__name__}."
            )
        mesh = resolve_mesh(n, mesh, devices, model_parallel)
        if isinstance(shared_rngs, str):
            shared_rngs = (shared_rngs,)
        if not isinstance(shared_rngs, Sequence | frozenset | set) or not all(
            isinstance(name, str) for name in shared_rngs
        ):
            raise TypeError(
                "shared_rngs= takes the names of the rng streams all members share, e.g. "
                f"('noise',); got {shared_rngs!r}."
            )
        self._model = model
        self._in_axes = check_in_axes(in_axes)
        self._shared_rngs = frozenset(shared_rngs)
        self._members = Members(int(n), mesh, merge_rules(rules), axis_name, bool(data_parallel))
        self._cache = ProgramCache()
        self._warned_method = False
        self._warned_shared: set[tuple[str, str]] = set()
        self._read_by_init = OutsideValues("ens.init")
        self._read_by_apply = OutsideValues("ens.apply")

    # ------------------------------------------------------------------ properties

    @property
    def n(self) -> int:
        """Number of members."""
        return self._members.n

    @property
    def mesh(self) -> Mesh:
        """The ``('ensemble', 'data', 'model')`` mesh the members live on."""
        return self._members.mesh

    @property
    def rules(self) -> LogicalRules:
        """Logical axis rules in force (user rules merged over the defaults)."""
        return self._members.rules

    @property
    def members(self) -> Members:
        """The member runner (n, mesh, rules, axis name) every computation goes through."""
        return self._members

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
            f"LinenEnsemble({type(self._model).__name__}, n={self.n}, "
            f"mesh={dict(self.mesh.shape)}, in_axes={self._in_axes})"
        )

    # ------------------------------------------------------------------ init

    def init(self, rng: RngLike, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Initialises all members straight into their shards; returns unboxed variables.

        Args:
          rng: a key (``jax.random.key`` or legacy ``PRNGKey``; used for ``'params'``), an int
            seed, or a dict ``{'params': key, 'dropout': key, ...}``. Each stream is split into n
            keys, member i gets ``jax.random.split(key, n)[i]`` (unless in ``shared_rngs``).
          *args: sample inputs, as for ``model.init`` (per-member if ``in_axes=0``). Arrays
            are traced; Python values (``train=False``, a mode string, a dict of settings)
            reach the module as they are (static: a new value compiles once).
          **kwargs: keyword arguments of the module's ``__call__``, shared by all members;
            arrays and Python values as in ``args``.

        Returns:
          ``{'params': ..., <other collections>: ...}``, every leaf ``[n, ...]`` and sharded on
          the member axis (and further mesh axes through logical annotations and rules).
        """
        # (as_if_outside_meshes says why a caller's mesh is set aside)
        with as_if_outside_meshes(self.mesh):
            jitted, _, call_args = self._init_program(rng, args, kwargs)
            with explained_errors():
                return jitted(*call_args)

    def init_shardings(self, rng: RngLike, *args: Any, **kwargs: Any) -> Any:
        """The ``NamedSharding`` of every leaf that :meth:`init` returns (nothing is computed).

        Useful to restore a checkpoint straight into shards.
        """
        with as_if_outside_meshes(self.mesh):
            return self._init_program(rng, args, kwargs)[1]

    def lower_init(self, rng: RngLike, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The lowered init program, e.g. ``ens.lower_init(k, x).compile().memory_analysis()``
        to see that each device only ever holds its share."""
        with as_if_outside_meshes(self.mesh):
            jitted, _, call_args = self._init_program(rng, args, kwargs)
            return jitted.lower(*call_args)

    def _init_program(self, rng: RngLike, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        keys = stream_keys(rng, default="params", mesh=self.mesh)
        self._check_shared_names(keys)
        axes = self._check_args(args)
        (arrays, kw_arrays), static = self._split(args, kwargs)
        call_args = (keys, arrays, kw_arrays)
        outside = self._read_by_init(self._model)
        cache_key = ("init", static, abstract_signature(call_args), outside)
        make = lambda: self._make_init(axes, static, call_args)
        jitted, shardings = self._cache.get_or_make(cache_key, make)
        return jitted, shardings, call_args

    def _make_init(self, axes, static, call_args) -> tuple[Any, Any]:
        model, members = self._model, self._members

        def boxed_init(keys, arrays, kw_arrays, unbox):
            split, shared = _by_axis(*members.split_keys(keys, self._shared_rngs))

            def one(split, shared, kw_arrays, *arrays):
                args, kwargs = _join(arrays, kw_arrays, static)
                with _axes_named_in_annotations(members.mesh):
                    out = model.init({**split, **shared}, *args, **kwargs)
                    # Unboxing inside the member applies each annotation's constraint at the
                    # member's own rank, resolved by Flax against the member's devices.
                    return _unbox(out) if unbox else out

            run_args = (split, shared, kw_arrays, *arrays)
            run_axes = (0, None, None, *axes)
            batched = (False, False, False, *([True] * len(arrays)))
            # Members sharing a device run one after another: a batched LAPACK call per CPU
            # device (orthogonal init's QR) next to the RNG can hang XLA's CPU runtime.
            return members.map(one, run_args, run_axes, batched=batched, sequential=True)

        boxed = jax.eval_shape(lambda *a: boxed_init(*a, False), *call_args)
        self._warn_unmapped(boxed)
        shardings = jax.tree_util.tree_map_with_path(self._leaf_sharding, boxed, is_leaf=_is_box)
        warn_if_model_axis_unused(shardings, self.mesh)
        return jax.jit(lambda *a: boxed_init(*a, True), out_shardings=shardings), shardings

    def _leaf_sharding(self, path: Any, leaf: Any) -> NamedSharding:
        names, spec, unsplit = None, None, "map its logical name to None in rules="
        if isinstance(leaf, nn.LogicallyPartitioned):
            names = leaf.names
        elif isinstance(leaf, meta.Partitioned):  # names are mesh axes already
            spec = PartitionSpec(MEMBER_AXIS, *leaf.names)
            unsplit = "write None for that axis in its nn.with_partitioning names"
        if isinstance(leaf, meta.AxisMetadata):
            leaf = leaf.unbox(apply_constraint=False)
        spec = spec or member_pspec(len(leaf.shape), names, self.rules)
        check_split(path, leaf.shape, spec, self.mesh, unsplit)
        return NamedSharding(self.mesh, spec)

    def _warn_unmapped(self, boxed: Any) -> None:
        names = [
            leaf.names
            for leaf in jax.tree.leaves(boxed, is_leaf=_is_box)
            if isinstance(leaf, nn.LogicallyPartitioned)
        ]
        warn_unmapped(names, self.rules, self.mesh)

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
          *args: inputs, shared (``in_axes=None``) or per-member with leading axis n. Arrays
            are traced; Python values reach the module as they are (static: a new value
            compiles once), so ``if train:`` works.
          rngs: ``{'dropout': key, ...}``; each stream is split per member like in :meth:`init`.
          mutable: collections to update, as in ``model.apply`` (e.g. ``['batch_stats']``);
            then ``(outputs, updates)`` is returned, the updates member-major too.
          method: a method name or function of the module to run instead of ``__call__``.
          **kwargs: keyword arguments of the method (``train=True``), shared by all members.
            Python values are static (a new value compiles once); arrays are traced.
        """
        self._check_variables(variables)
        check_on_mesh(variables, self.mesh, "variables", member_major=True)
        axes = self._check_args(args)
        check_shared_kwargs(kwargs, self.n, self.mesh)
        if rngs is not None and not isinstance(rngs, Mapping):
            raise TypeError(
                "rngs= must be a dict of keys per stream, e.g. {'dropout': jax.random.key(0)}; "
                f"got {type(rngs).__name__}."
            )
        with as_if_outside_meshes(self.mesh):  # a seed's key: not typed with a caller's mesh
            keys = stream_keys(rngs, default=None, mesh=self.mesh) if rngs else {}
        self._check_shared_names(keys)
        if isinstance(mutable, list | tuple):
            mutable = tuple(mutable)
        (arrays, kw_arrays), static = self._split(args, kwargs)
        outside = self._read_by_apply(method, self._model)
        cache_key = ("apply", static, mutable, method, tuple(sorted(keys)), axes, outside)
        if cache_key not in self._cache:
            self._warn_new_function(method)
        make = lambda: self._make_apply(static, mutable, method, axes)
        jitted = self._cache.get_or_make(cache_key, make)
        with as_if_outside_meshes(self.mesh), explained_errors():  # (see init)
            return jitted(variables, keys, arrays, kw_arrays)

    def _check_shared_names(self, keys: Mapping[str, Any]) -> None:
        """A ``shared_rngs`` name that a call's rngs lack while they have a stream spelled
        almost like it (``'dropuot'`` / ``'dropout'``) is a misspelling, and the stream it
        meant is then split per member without a word: warn, once per pair. (An apply may
        use only some of the shared streams: a missing name alone says nothing.)"""
        split = [k for k in keys if k not in self._shared_rngs]
        for name in sorted(self._shared_rngs - set(keys)):
            for close in difflib.get_close_matches(name, split, n=1, cutoff=0.75):
                if (name, close) not in self._warned_shared:
                    self._warned_shared.add((name, close))
                    warn_user(
                        f"shared_rngs names {name!r}, and this call's rngs have {close!r} "
                        "instead: misspelled? That stream is split per member.",
                    )

    def _make_apply(self, static, mutable, method, axes) -> Callable[..., Any]:
        model, members = self._model, self._members

        def one(variables, split, shared, kw_arrays, *arrays):
            rngs = {**split, **shared} or None
            args, kw = _join(arrays, kw_arrays, static)
            return model.apply(variables, *args, rngs=rngs, mutable=mutable, method=method, **kw)

        def apply_fn(variables, keys, arrays, kw_arrays):
            split, shared = _by_axis(*members.split_keys(keys, self._shared_rngs))
            run_args = (variables, split, shared, kw_arrays, *arrays)
            run_axes = (0, 0, None, None, *axes)
            batched = (False, False, False, False, *([True] * len(arrays)))
            return members.map(one, run_args, run_axes, batched=batched)

        return jax.jit(apply_fn)

    def _warn_new_function(self, method: Any) -> None:
        """Warns (once) when ``method`` is a new function object with the code of one already
        compiled: a lambda written in the call, compiled anew on every call (a plain
        ``model.apply`` takes it for free), about ten times the time of a compiled call."""
        code = getattr(method, "__code__", None)
        if code is None or self._warned_method:
            return
        if any(
            k[0] == "apply" and k[3] is not method and getattr(k[3], "__code__", None) is code
            for k in self._cache
        ):
            self._warned_method = True
            warn_user(
                f"ens.apply got a new function object as method= ({method.__qualname__}) with "
                "the code of one it already compiled; each new function compiles anew. Define "
                "it once, outside the loop, or pass a method name (method='encode').",
            )

    @staticmethod
    def _split(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, Hashable]:
        """Each positional input's array leaves and the keyword inputs' (traced), and the
        Python values around them (static: ``train=True``, ``'mode'``), as one cache key."""
        parts = [split_static(a, f"input {i}") for i, a in enumerate(args)]
        kw_arrays, kw_static = split_static(dict(kwargs), "keyword input ")
        arrays = tuple(a for a, _ in parts)
        return (arrays, kw_arrays), (tuple(s for _, s in parts), kw_static)

    # ------------------------------------------------------------------ training

    def train_step(self, loss_fn: Callable[..., Any], tx: Any, **options: Any) -> TrainStep:
        """:func:`ensemble.train_step` for this ensemble (its n, mesh, rules and axis name).

        ``per_member_batch`` defaults to this ensemble's ``in_axes``: an ensemble built with
        ``in_axes=0`` trains on per-member batches (leading axis n), one with ``in_axes=None``
        on shared ones; with a tuple of ``in_axes``, give it.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
          >>> ens = LinenEnsemble(nn.Dense(1), n=8)
          >>> params = ens.init(jax.random.key(0), jnp.ones((4, 3)))["params"]
          >>> step = ens.train_step(
          ...     lambda p, x: jnp.mean(ens.model.apply({"params": p}, x) ** 2), optax.sgd(0.1))
          >>> params, opt_state, losses = step(params, step.init(params), jnp.ones((4, 3)))
          >>> losses.shape
          (8,)
        """
        from ensemble._train import TrainStep

        if "per_member_batch" not in options:
            options["per_member_batch"] = batch_default(self._in_axes)
        return TrainStep.for_members(loss_fn, tx, self._members, **options)

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
        return take_member(dict(variables), member_index(i, self.n), self.mesh, self.n)

    # ------------------------------------------------------------------ checks

    def _check_args(self, args: tuple[Any, ...]) -> tuple[int | None, ...]:
        axes = arg_axes(self._in_axes, len(args))
        check_inputs(args, axes, self.n, "input", *INPUT_FIXES, mesh=self.mesh)
        return axes

    def _check_variables(self, variables: Any) -> None:
        if not isinstance(variables, Mapping):
            raise TypeError(
                f"variables must be the dict that ens.init returns, got {type(variables).__name__}."
            )
        check_member_major(
            dict(variables),
            self.n,
            "variables leaf ",
            "Pass the variables from ens.init (a single member's variables go to ens.model.apply).",
        )
        check_live(dict(variables), "variables leaf ")


# ---------------------------------------------------------------------- helpers


def warn_if_model_axis_unused(shardings: Any, mesh: Mesh) -> None:
    """model_parallel=k with no parameter split over 'model' (no rule maps to it) copies each
    member whole onto all k of its model devices: k times the memory, silently."""
    k = mesh.shape.get(MODEL_AXIS, 1)
    specs = [s.spec for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)]
    used = any(
        MODEL_AXIS in (entry if isinstance(entry, tuple) else (entry,))
        for spec in specs
        for entry in spec
    )
    if k > 1 and not used:
        warn_user(
            f"each member spans {k} devices of the 'model' axis, but no parameter is split over "
            f"it (no parameter annotation resolves to 'model'), so each member's parameters are "
            f"whole on all {k}: annotate parameters and add rules such as rules=[('hidden', "
            "'model')], or use model_parallel=1."
        )


def warn_unmapped(names: Sequence[Sequence[Any]], rules: LogicalRules, mesh: Mesh) -> None:
    """Warns about logical names of parameter annotations that no rule maps, when that really
    drops a split: only if a member spans several devices (otherwise there is nothing to split)."""
    if devices_per_member(mesh) == 1:
        return
    missing = unmapped_names(names, rules)
    if missing:
        warn_user(
            f"parameter annotations use logical axes {missing} that no rule maps to a mesh axis "
            f"(rules: {rules}); each member spans {devices_per_member(mesh)} devices, and those "
            "dimensions will be replicated on all of them. Add (name, <mesh axis or None>) to "
            "rules= to make the choice explicit.",
        )


def _by_axis(
    keys: Mapping[str, jax.Array], axes: Mapping[str, int | None]
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Split keys (one per member) and shared keys, as two dicts."""
    split = {k: v for k, v in keys.items() if axes[k] == 0}
    return split, {k: v for k, v in keys.items() if axes[k] is None}


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


@contextlib.contextmanager
def _axes_named_in_annotations(mesh: Mesh) -> Iterator[None]:
    """JAX's error for an ``nn.with_partitioning`` name the mesh lacks, as one line with the fix
    (it named neither the annotation's kind nor what to write instead)."""
    try:
        yield
    except ValueError as e:
        found = re.search(r"Resource axis: (\S+) of (.*) is not found in mesh", str(e))
        if found is None:
            raise
        raise ValueError(
            f"an nn.with_partitioning annotation {found[2]} names mesh axis {found[1]!r}, which "
            f"the ensemble's mesh {tuple(mesh.axis_names)} lacks: name 'data' or 'model' there, "
            "or None to leave that dimension whole (or use nn.with_logical_partitioning names "
            "and rules=)."
        ) from None


def _unbox(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: x.unbox() if isinstance(x, meta.AxisMetadata) else x, tree, is_leaf=_is_box
    )


def _join(arrays: Sequence[Any], kw_arrays: Sequence[Any], static: Hashable) -> Any:
    """``(args, kwargs)`` of one member call from what :meth:`LinenEnsemble._split` split."""
    statics, kw_static = static
    return [join_static(a, s) for a, s in zip(arrays, statics)], join_static(kw_arrays, kw_static)
