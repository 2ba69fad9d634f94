"""Sharded model ensembles: n members of one Flax model, each on its own device(s).

Everyday names are here: :func:`build` (linen module or NNX factory -> ensemble),
:func:`train_step` / ``ens.train_step`` (donated, per-member optax), :func:`per_member`, the
reductions over members (:func:`mean`, :func:`variance`, :func:`disagreement`,
:func:`log_mean_exp`, :func:`member`) and :func:`compiled_memory`. Sharding tools live in
:mod:`ensemble.sharding`, checks and memory tools in :mod:`ensemble.debug`, multi-process helpers
in :mod:`ensemble.distributed`.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn, ensemble
  >>> ens = ensemble.build(nn.Dense(3), n=jax.device_count())
  >>> variables = ens.init(jax.random.key(0), jnp.ones((2, 5)))
  >>> ens.apply(variables, jnp.ones((2, 5))).shape[0] == jax.device_count()
  True
"""

from ensemble import debug, distributed, sharding
from ensemble._build import build
from ensemble._checks import (
    assert_member_axis,
    assert_member_placement,
    assert_no_replicated_members,
)
from ensemble._linen import LinenEnsemble
from ensemble._memory import CompiledMemory, compiled_memory, live_memory, print_memory
from ensemble._mesh import (
    DATA_AXIS,
    DEFAULT_RULES,
    MEMBER_AXIS,
    MODEL_AXIS,
    layout,
    make_mesh,
    member_sharding,
    partitioning,
    shard_members,
)
from ensemble._nnx import (
    NNXEnsemble,
    NNXTrainStep,
    lower_build_nnx,
    nnx_optimizer,
    nnx_train_step,
)
from ensemble._optim import per_member
from ensemble._reduce import disagreement, log_mean_exp, mean, member, variance
from ensemble._train import TrainStep, train_step

# The everyday surface. The names imported above but not listed here stay importable from the
# top for existing code; their home is ensemble.sharding / ensemble.debug.
__all__ = [
    "LinenEnsemble",
    "NNXEnsemble",
    "NNXTrainStep",
    "TrainStep",
    "build",
    "compiled_memory",
    "debug",
    "disagreement",
    "distributed",
    "log_mean_exp",
    "mean",
    "member",
    "nnx_optimizer",
    "nnx_train_step",
    "per_member",
    "sharding",
    "train_step",
    "variance",
]
_COMPAT = (
    DATA_AXIS,
    DEFAULT_RULES,
    MEMBER_AXIS,
    MODEL_AXIS,
    CompiledMemory,
    assert_member_axis,
    assert_member_placement,
    assert_no_replicated_members,
    layout,
    live_memory,
    lower_build_nnx,
    make_mesh,
    member_sharding,
    partitioning,
    print_memory,
    shard_members,
)
