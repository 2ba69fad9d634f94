"""``ensemble.build``: one entry point for linen modules and NNX module factories."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, overload

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh

from ensemble._core import InAxes
from ensemble._linen import LinenEnsemble

if TYPE_CHECKING:
    from ensemble._nnx import NNXEnsemble


@overload
def build(
    model: nn.Module,
    n: int,
    *,
    mesh: Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    model_parallel: int = 1,
    rules: Sequence[tuple[str, Any]] | None = None,
    in_axes: InAxes = None,
    axis_name: str | None = None,
    **kwargs: Any,
) -> LinenEnsemble: ...


@overload
def build(
    model: Callable[..., nnx.Module],
    n: int,
    *,
    mesh: Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    model_parallel: int = 1,
    rules: Sequence[tuple[str, Any]] | None = None,
    in_axes: InAxes = None,
    axis_name: str | None = None,
    **kwargs: Any,
) -> NNXEnsemble: ...


def build(
    model: nn.Module | Callable[..., nnx.Module],
    n: int,
    *,
    mesh: Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    model_parallel: int = 1,
    rules: Sequence[tuple[str, Any]] | None = None,
    in_axes: InAxes = None,
    axis_name: str | None = None,
    **kwargs: Any,
) -> LinenEnsemble | NNXEnsemble:
    """Makes an n-member ensemble of ``model``, each member on its own device(s).

    Args:
      model: a linen ``nn.Module`` instance (-> :class:`ensemble.LinenEnsemble`), or an NNX
        factory ``rngs -> nnx.Module`` / an ``nnx.Module`` subclass (-> ``ensemble.NNXEnsemble``).
      n: number of members: a multiple of the device count (several members per device) or a
        divisor of it (each member spans ``D / n`` devices).
      mesh: a mesh from :func:`ensemble.make_mesh`; default: one over ``devices``.
      devices: devices to use for the default mesh (default: all of ``jax.devices()``).
      model_parallel: devices per member for tensor parallelism (rules onto ``'model'``).
      rules: logical axis rules, merged over :data:`ensemble.DEFAULT_RULES`.
      in_axes: ``None`` for inputs shared by all members, ``0`` for per-member inputs.
      axis_name: a name bound inside every member to its data-parallel axis, for models written
        for ``pmap`` (``BatchNorm(axis_name='batch')``, ``lax.pmean(x, 'batch')``): a member is
        one replica over its whole batch, so statistics are over the member's batch.
      **kwargs: linen: ``shared_rngs=``, ``data_parallel=`` (see :class:`LinenEnsemble`);
        NNX: passed to the NNX builder (e.g. the module class's constructor arguments).

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> ens = build(nn.Dense(3), n=16)  # two members per device on 8 devices
      >>> ens.apply(ens.init(jax.random.key(0), jnp.ones((2, 4))), jnp.ones((2, 4))).shape
      (16, 2, 3)
    """
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise TypeError(
            f"build got the linen Module class {model.__name__}; instantiate it: "
            f"ensemble.build({model.__name__}(...), n)."
        )
    linen = isinstance(model, nn.Module)
    _check_same_on_every_process(
        mesh, devices, kind="linen" if linen else "nnx", n=n,
        model_parallel=model_parallel, in_axes=in_axes, axis_name=axis_name,
    )  # fmt: skip
    layout = dict(mesh=mesh, devices=devices, model_parallel=model_parallel, rules=rules,
                  in_axes=in_axes, axis_name=axis_name)  # fmt: skip
    if linen:
        return LinenEnsemble(model, n, **layout, **kwargs)
    _refuse_what_is_no_nnx_factory(model)
    from ensemble._nnx import build_nnx

    return build_nnx(model, n, **layout, **kwargs)


def _refuse_what_is_no_nnx_factory(model: Any) -> None:
    """One line for what ``build`` cannot take as an NNX factory (a linen model was taken)."""
    if isinstance(model, nnx.Module):
        raise TypeError(
            f"build got an nnx.Module instance ({type(model).__name__}); members need fresh "
            "variables, so pass a factory: ensemble.build(lambda rngs: MyModel(..., rngs=rngs), n)."
        )
    if isinstance(model, type) and not issubclass(model, nnx.Module):
        raise TypeError(
            f"build got the class {model.__name__}, which is neither a linen nn.Module nor an "
            "nnx.Module; pass a linen module instance or an NNX factory rngs -> nnx.Module."
        )
    if not callable(model):
        raise TypeError(
            f"build needs a linen nn.Module instance or an NNX factory rngs -> nnx.Module, got "
            f"{type(model).__name__}."
        )


def _check_same_on_every_process(
    mesh: Mesh | None, devices: Sequence[jax.Device] | None, **settings: Any
) -> None:
    """An ensemble over the devices of several processes is built by all of them at once, the
    same on each: with another ``n`` (or layout) on one, each process made global arrays of
    its own shape, unchecked, and ran another program on them (a collective aborted in gloo,
    naming nothing). Compared through JAX's coordinator before anything runs; an ensemble on
    this process's devices alone is its own business."""
    if jax.process_count() == 1:
        return
    spanned = list(mesh.devices.flat) if mesh is not None else list(devices or jax.devices())
    if all(d.process_index == jax.process_index() for d in spanned):
        return
    from ensemble._distributed import numeric_jax_settings, settings_that_differ

    settings = {k: repr(v) for k, v in settings.items()} | numeric_jax_settings()
    # In order, and the mesh's shape: the same devices in another order are another ensemble
    # (each process computed its own members in both slots, and the others never).
    shape = list(mesh.devices.shape) if mesh is not None else None
    differ = settings_that_differ({**settings, "devices": [d.id for d in spanned], "mesh": shape})
    if differ:
        raise ValueError(
            f"ensemble.build: the processes built an ensemble over their devices with "
            f"different {', '.join(differ)}; every process builds the same ensemble (the "
            "same n, model_parallel, devices or mesh, in_axes and axis_name), in the same order, "
            "under the same JAX settings (JAX_ENABLE_X64, JAX_DEFAULT_PRNG_IMPL, ...)."
        )
