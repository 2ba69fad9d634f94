"""Grouped convolutions that XLA gets wrong under tensor parallelism: found and refused first.

A train step traces one member's loss before it compiles (only where members have several
``'model'`` devices) and refuses, in one line, two cases XLA's SPMD partitioner breaks:

- A member over both ``'data'`` and ``'model'`` devices with any grouped convolution: its
  kernel gradient comes out ``'model'`` times too large, silently (plain ``jax.jit`` of such a
  conv on such a mesh too, the kernel split or not; jax 0.10.2): 2x on 2 x 2 and 4 x 2
  devices, 4x on 2 x 4, right where one of the two axes has size 1. An ensemble call whose
  members run one warns instead (its outputs are right; a gradient through it is not).
- A grouped convolution (``feature_group_count`` G > 1) whose kernel's input or output
  features are split over P of a member's ``'model'`` devices, where P does not divide G,
  puts one group on several devices. Init and the forward pass compile and are right, but
  compiling the gradient aborts the whole process in XLA (``convolution_handler.cc: Check
  failed: new_input_batch_size % new_output_batch_size == 0``, exit 134) wherever the member
  runs under ``jax.shard_map`` with the member axis manual (plain Flax under ``jax.jit``
  compiles the same split). Seen on 8 CPU devices, kernel [3, 3, 8 / G, 8]: output features
  split, G, P = 2, 4 aborts; 2, 2 / 4, 2 / 4, 4 / 8, 4 compile; input features split, 2, 4
  aborts; 2, 2 and 4, 2 compile (their other splits are uneven, refused elsewhere).

The kernel is followed back to a parameter through dtype casts, sharding constraints, ``jit``,
remat and a scan's constants; a kernel made otherwise is not seen.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core
from jax.sharding import Mesh, NamedSharding

from ensemble._mesh import DATA_AXIS, MODEL_AXIS
from ensemble._warn import warn_user

# Ops that hand the kernel on unchanged but for its dtype or placement.
_PASS_THROUGH = {"convert_element_type", "copy", "copy_p", "sharding_constraint", "reshard"}
# Ops whose inner program takes exactly the op's inputs, in order (a scan's constants only: its
# other inputs are carries and slices, not the parameter as it is).
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "remat2": "jaxpr",
          "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "scan": "jaxpr"}  # fmt: skip


def refuse_split_grouped_convs(
    member_loss: Callable[..., Any],
    state: Any,
    name: str,
    batch: Sequence[Any],
    axes: Sequence[int | None],
    mesh: Mesh,
) -> None:
    """Raises ``ValueError`` for a grouped conv in ``member_loss(state, *batch)`` of one member
    that XLA gets wrong on ``mesh`` (above). ``state`` (called ``name``) is member-major;
    ``axes[i]``: 0 for a member-major batch argument, None for a shared one. A loss that cannot
    be traced here is left to the step, which says what is wrong with it."""
    if mesh.shape.get(MODEL_AXIS, 1) == 1:  # the one within-member axis parameters split over
        return
    args = [(state, name, True)]
    args += [(b, f"batch argument {i}", a == 0) for i, (b, a) in enumerate(zip(batch, axes))]
    try:
        views = [_one_member(tree, what, member_major) for tree, what, member_major in args]
        jaxpr = jax.make_jaxpr(member_loss)(*(v for v, _, _ in views)).jaxpr
    except Exception:  # the step's own call raises it, with its own message
        return
    specs = [s for _, ss, _ in views for s in ss]
    names = [n for _, _, ns in views for n in ns]
    _refuse_grouped_convs_over_data_and_model(jaxpr, mesh)
    if len(jaxpr.invars) != len(specs):
        return
    origin = {v: i for i, v in enumerate(jaxpr.invars)}
    for leaf, dims, groups in _grouped_kernels(jaxpr, origin):
        spec = tuple(specs[leaf] or ())
        for dim, what in zip(dims, ("output", "input")):
            axes = spec[dim] if dim < len(spec) else None
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            parts = math.prod(mesh.shape[a] for a in axes)
            if parts > 1 and groups % parts:
                raise ValueError(
                    f"{names[leaf]} is the kernel of a grouped convolution (feature_group_count="
                    f"{groups}) whose {what} features are split over {parts} devices of a member "
                    f"({', '.join(map(repr, axes))}), so one group spans several devices: XLA's "
                    "partitioner aborts the process compiling its gradient. Give a model_parallel "
                    f"that divides {groups}, or leave that kernel axis unsplit (None in its "
                    "partitioning or rules=)."
                )


# The fix for a member over both 'data' and 'model' devices, given its device count.
_ONE_AXIS = (
    "Put each member's devices on one axis: model_parallel=1, or model_parallel={} (or as many "
    "members as devices / model_parallel)."
)


def _refuse_grouped_convs_over_data_and_model(jaxpr: core.Jaxpr, mesh: Mesh) -> None:
    """A member over both 'data' and 'model' devices gets a grouped conv's kernel gradient
    'model' times too large from XLA, silently (plain ``jax.jit`` of such a conv on such a mesh
    too, kernel split or not; jax 0.10.2): refused."""
    data, model = mesh.shape.get(DATA_AXIS, 1), mesh.shape[MODEL_AXIS]
    groups = _group_counts(jaxpr) if data > 1 else []
    if groups:
        raise ValueError(
            f"the loss has a grouped convolution (feature_group_count={max(groups)}) and each "
            f"member spans {data} 'data' x {model} 'model' devices, where XLA computes a grouped "
            f"convolution's kernel gradient {model} times too large, silently. "
            + _ONE_AXIS.format(data * model)
        )


def warn_of_grouped_convs_over_data_and_model(
    fn: Callable[..., Any], args: Sequence[Any], axes: Sequence[int | None], mesh: Mesh
) -> None:
    """Warns where an ensemble call's members (``fn`` of one member's ``args``: ``axes`` as in
    ``Members.map``) run a grouped conv over both 'data' and 'model' devices: the outputs are
    right, gradients taken through the call are not (the train steps refuse it)."""
    data, model = mesh.shape.get(DATA_AXIS, 1), mesh.shape.get(MODEL_AXIS, 1)
    if data == 1 or model == 1:
        return
    try:
        avals = [_one_member(a, "", ax == 0)[0] for a, ax in zip(args, axes)]
        groups = _group_counts(jax.make_jaxpr(fn)(*avals).jaxpr)
    except Exception:  # the call itself says what is wrong
        return
    if groups:
        warn_user(
            f"the members run a grouped convolution (feature_group_count={max(groups)}) over "
            f"{data} 'data' x {model} 'model' devices each: their outputs are right, but XLA "
            f"computes its kernel's gradient {model} times too large there, so do not "
            "differentiate through this call (ensemble's train steps refuse it). "
            + _ONE_AXIS.format(data * model)
        )


def _group_counts(jaxpr: core.Jaxpr) -> list[int]:
    """The ``feature_group_count`` (> 1) of every convolution in ``jaxpr`` and those inside it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated" and eqn.params["feature_group_count"] > 1:
            found.append(eqn.params["feature_group_count"])
        for inner in core.jaxprs_in_params(eqn.params):
            found += _group_counts(inner)
    return found


def _one_member(tree: Any, name: str, member_major: bool) -> tuple[Any, list, list[str]]:
    """One member's abstract ``tree``, each leaf's partition spec within a member (``None``:
    unknown, or a shared input) and name."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    avals, specs, names = [], [], []
    for path, x in leaves:
        if hasattr(x, "dtype") and hasattr(x, "shape"):
            avals.append(jax.ShapeDtypeStruct(x.shape[1:] if member_major else x.shape, x.dtype))
        else:
            avals.append(x)
        try:  # a tracer has none
            sharding = x.sharding if member_major else None
        except Exception:
            sharding = None
        specs.append(tuple(sharding.spec)[1:] if isinstance(sharding, NamedSharding) else None)
        names.append(name + jax.tree_util.keystr(path))
    return treedef.unflatten(avals), specs, names


def _grouped_kernels(jaxpr: core.Jaxpr, origin: dict) -> list[tuple[int, tuple[int, int], int]]:
    """(input leaf, (output dim, input dim), groups) of each grouped conv whose kernel is an
    input of ``jaxpr`` passed on unchanged (``origin``: variable -> input leaf)."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [origin.get(v) if isinstance(v, core.Var) else None for v in eqn.invars]
        if name in _PASS_THROUGH and ins and ins[0] is not None:
            origin[eqn.outvars[0]] = ins[0]
        elif name in _CALLS and _CALLS[name] in eqn.params:
            inner = eqn.params[_CALLS[name]]
            inner = getattr(inner, "jaxpr", inner)
            if len(inner.invars) == len(ins):
                if name == "scan":
                    ins = ins[: eqn.params["num_consts"]]
                inner_origin = {v: i for v, i in zip(inner.invars, ins) if i is not None}
                found += _grouped_kernels(inner, inner_origin)
        elif name == "conv_general_dilated" and eqn.params["feature_group_count"] > 1:
            kernel = ins[1]
            if kernel is not None:
                rhs = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *window)
                found.append((kernel, (rhs[0], rhs[1]), eqn.params["feature_group_count"]))
    return found
