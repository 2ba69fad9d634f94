"""Checks and memory tools: where members really are, and what each device really holds.

- chex-style assertions read off ``addressable_shards`` (metadata is not placement):
  :func:`assert_member_axis`, :func:`assert_member_placement`,
  :func:`assert_no_replicated_members`;
- memory: :func:`live_memory` (bytes of live shards per device), :func:`compiled_memory`
  (per-device argument / output / temp / alias / peak of a compiled program),
  :func:`print_memory`;
- :func:`collectives`: cross-device collectives in a compiled program, or with
  ``across_members=True`` only those that group devices of different members (an ensemble
  program should have none; a member spread over several devices may need its own).

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn, ensemble
  >>> from ensemble import debug
  >>> ens = ensemble.build(nn.Dense(2), 8)
  >>> variables = ens.init(jax.random.key(0), jnp.ones((1, 3)))
  >>> debug.assert_member_placement(variables, ens.mesh)
  >>> debug.collectives(jax.jit(ens.apply).lower(variables, jnp.ones((1, 3))))
  {}
"""

from ensemble._checks import (
    assert_member_axis,
    assert_member_placement,
    assert_no_replicated_members,
)
from ensemble._collectives import collectives
from ensemble._memory import (
    CompiledMemory,
    compiled_memory,
    live_memory,
    print_memory,
)

__all__ = [
    "CompiledMemory",
    "assert_member_axis",
    "assert_member_placement",
    "assert_no_replicated_members",
    "collectives",
    "compiled_memory",
    "live_memory",
    "print_memory",
]
