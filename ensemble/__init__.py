"""Sharded model ensembles: n members of one Flax model, each on its own device(s).

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn, ensemble
  >>> ens = ensemble.build(nn.Dense(3), n=jax.device_count())
  >>> variables = ens.init(jax.random.key(0), jnp.ones((2, 5)))
  >>> ens.apply(variables, jnp.ones((2, 5))).shape[0] == jax.device_count()
  True
"""

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

__all__ = [
    "DATA_AXIS",
    "DEFAULT_RULES",
    "MEMBER_AXIS",
    "MODEL_AXIS",
    "CompiledMemory",
    "LinenEnsemble",
    "NNXEnsemble",
    "NNXTrainStep",
    "TrainStep",
    "assert_member_axis",
    "assert_member_placement",
    "assert_no_replicated_members",
    "build",
    "compiled_memory",
    "disagreement",
    "layout",
    "live_memory",
    "log_mean_exp",
    "lower_build_nnx",
    "make_mesh",
    "mean",
    "member",
    "member_sharding",
    "nnx_optimizer",
    "nnx_train_step",
    "partitioning",
    "per_member",
    "print_memory",
    "shard_members",
    "train_step",
    "variance",
]
