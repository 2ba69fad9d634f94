"""Sharding tools: the ensemble mesh, logical rules and member-axis placement.

Everyday use needs none of these (``ensemble.build`` makes the mesh and places every leaf);
they are for building a mesh by hand, placing arrays made outside the library, and using the
ensemble's rules in your own code.

Example:
  >>> from ensemble import sharding
  >>> sharding.make_mesh(4).axis_names
  ('ensemble', 'data', 'model')
"""

from ensemble._mesh import (
    DATA_AXIS,
    DEFAULT_RULES,
    MEMBER_AXIS,
    MODEL_AXIS,
    layout,
    make_mesh,
    member_pspec,
    member_sharding,
    partitioning,
    shard_members,
)

__all__ = [
    "DATA_AXIS",
    "DEFAULT_RULES",
    "MEMBER_AXIS",
    "MODEL_AXIS",
    "layout",
    "make_mesh",
    "member_pspec",
    "member_sharding",
    "partitioning",
    "shard_members",
]
