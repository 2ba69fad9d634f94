"""Reductions over the member axis (axis 0) of ensemble outputs, and taking one member out.

All functions are jit-friendly and work on member-sharded arrays: the reduction over axis 0 is
the only cross-member communication. Each one is a single compiled program (called eagerly, op
by op, ``disagreement`` compiled eleven small ones at each new shape and ran 10x slower).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.typing import ArrayLike

from ensemble._core import check_live
from ensemble._mesh import MEMBER_AXIS, member_index, no_mesh_set, take_member


def mean(y: ArrayLike) -> jax.Array:
    """Ensemble mean over the member axis: ``y[n, ...] -> [...]``.

    Example:
      >>> import jax.numpy as jnp
      >>> mean(jnp.array([[1.0, 2.0], [3.0, 6.0]]))
      Array([2., 4.], dtype=float32)
    """
    with no_mesh_set():  # (an ensemble's output under a mesh of the caller's: as outside it)
        return _mean(_member_major(y, "mean"))


def variance(y: ArrayLike, *, ddof: int = 0) -> jax.Array:
    """Variance over the member axis (population variance by default; ``ddof=1`` for sample).

    Example:
      >>> import jax.numpy as jnp
      >>> variance(jnp.array([[1.0, 2.0], [3.0, 6.0]]))
      Array([1., 4.], dtype=float32)
    """
    with no_mesh_set():
        return _variance(_member_major(y, "variance"), ddof)


def log_mean_exp(log_probs: ArrayLike) -> jax.Array:
    """``log(mean_i exp(log_probs[i]))`` over members = ``logsumexp(axis=0) - log(n)``.

    The log of the ensemble's mean probability (the predictive mixture), computed stably: members
    with log-probabilities of -1000 do not underflow to ``-inf``. Computed in float32 at least
    (float16 has no ``log(65536)``: n beyond 65504 gave NaN) and returned in the input's
    dtype if that is a float dtype (float32 for integer inputs).

    Example:
      >>> import jax.numpy as jnp
      >>> float(log_mean_exp(jnp.array([-1000.0, -1000.0])))
      -1000.0
    """
    with no_mesh_set():
        return _log_mean_exp(_member_major(log_probs, "log_mean_exp"))


@jax.jit
def _log_mean_exp(log_probs: jax.Array) -> jax.Array:
    n = log_probs.shape[0]
    wide = log_probs.astype(jnp.promote_types(log_probs.dtype, jnp.float32))
    out = jax.nn.logsumexp(wide, axis=0) - jnp.log(jnp.asarray(n, wide.dtype))
    floating = jnp.issubdtype(log_probs.dtype, jnp.floating)
    return out.astype(log_probs.dtype) if floating else out


def disagreement(logits: ArrayLike) -> jax.Array:
    """Per example, the fraction of members whose top class differs from the ensemble's.

    ``logits`` are ``[n, ..., classes]``. The ensemble's top class is the argmax of the mean of
    the members' softmax probabilities (computed in float32 at least, whatever the logits'
    dtype); the result (shape ``[...]``, values in ``[0, 1]``) is
    the fraction of members whose own argmax is a different class. 0 means all members agree
    with the ensemble; 1 is possible when the mean's top class is no member's own (probabilities
    (.5, .05, .45) and (.05, .5, .45) average to a top class 2 that neither picks). A logit of
    ``+inf`` gives its class probability 1 (shared by the classes at ``+inf``); an example for
    which a member has no probabilities (a NaN logit, every logit ``-inf``: a diverged member)
    is NaN, not that member voting for class 0.

    Example:
      >>> import jax.numpy as jnp
      >>> logits = jnp.array([[[2.0, 0.0]], [[2.0, 0.0]], [[0.0, 1.0]], [[3.0, 0.0]]])  # [4, 1, 2]
      >>> disagreement(logits)
      Array([0.25], dtype=float32)
    """
    with no_mesh_set():
        logits = _member_major(logits, "disagreement")
        if logits.ndim < 2:
            raise ValueError(
                f"disagreement needs logits [n, ..., classes]; got shape {logits.shape}."
            )
        return _disagreement(logits)


@jax.jit
def _disagreement(logits: jax.Array) -> jax.Array:
    # In float32 at least: bfloat16 mean probabilities tie where the definition's do not.
    wide = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    top = wide == jnp.inf  # softmax's limit there; jax.nn.softmax gives NaN
    certain = top / jnp.sum(top, axis=-1, keepdims=True)
    probs = jnp.where(jnp.any(top, -1, keepdims=True), certain, jax.nn.softmax(wide, axis=-1))
    ensemble_top = jnp.argmax(jnp.mean(probs, axis=0), axis=-1)
    member_top = jnp.argmax(logits, axis=-1)
    share = jnp.mean((member_top != ensemble_top[None]).astype(jnp.float32), axis=0)
    # NaN where a member has no probabilities: a NaN logit (the +inf branch alone misses one
    # beside a +inf), or every logit -inf.
    missing = jnp.isnan(wide).any(axis=(0, -1)) | jnp.isnan(probs).any(axis=(0, -1))
    return jnp.where(missing, jnp.nan, share)


_mean = jax.jit(lambda y: jnp.mean(y, axis=0))
_variance = jax.jit(lambda y, ddof: jnp.var(y, axis=0, ddof=ddof))  # ddof may be traced


def member(tree_or_ensemble: Any, i: int) -> Any:
    """Member i: a slice ``[i]`` of every leaf of a member-major tree, or ``ens.member(i)``.

    For linen variables this gives plain variables for ``model.apply``; for an NNX ensemble
    (anything with a ``member(i)`` method) it defers to that method, which returns a plain module.
    Leaves split over an ensemble mesh's ``'ensemble'`` axis (what ``ens.init`` returns) are
    assembled from the shards that hold member i: the result lives on member i's device(s) only,
    nothing is copied to the other devices.

    Example:
      >>> import jax.numpy as jnp
      >>> member({"params": {"w": jnp.arange(6).reshape(3, 2)}}, 1)["params"]["w"]
      Array([2, 3], dtype=int32)
    """
    from ensemble._linen import LinenEnsemble

    if isinstance(tree_or_ensemble, LinenEnsemble):
        raise TypeError(
            "a LinenEnsemble holds no variables; use ens.member(variables, i) or "
            "ensemble.member(variables, i)."
        )
    method = getattr(tree_or_ensemble, "member", None)
    if callable(method) and not isinstance(tree_or_ensemble, dict | list | tuple):
        return method(i)
    check_live(
        tree_or_ensemble, "member() input ", "use the arrays that step returned (their members)"
    )
    leaves = jax.tree_util.tree_leaves_with_path(tree_or_ensemble)
    if not leaves:
        raise ValueError("member() got an empty tree.")
    n = np.shape(leaves[0][1])[0] if np.ndim(leaves[0][1]) else None
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not shape or shape[0] != n:
            raise ValueError(
                f"leaf {jax.tree_util.keystr(path)} has shape {shape}; member() needs every leaf "
                f"to share a leading member axis (first leaf has {n})."
            )
    i = member_index(i, n)
    # Leaves split over an ensemble mesh's member axis keep member i on its devices; the rest
    # (host arrays, other layouts) are a[i].
    meshes = [getattr(getattr(a, "sharding", None), "mesh", None) for _, a in leaves]
    mesh = next((m for m in meshes if isinstance(m, Mesh) and MEMBER_AXIS in m.axis_names), None)
    if mesh is None:
        return jax.tree_util.tree_map(lambda a: a[int(i)], tree_or_ensemble)
    return take_member(tree_or_ensemble, int(i), mesh, n)


def _member_major(y: Any, what: str) -> jax.Array:
    y = jnp.asarray(y)
    if y.ndim == 0:
        raise ValueError(f"{what} needs a member axis first (shape [n, ...]); got a scalar.")
    return y
