"""Cross-device collectives in a compiled program, and which of them cross members.

Members of an ensemble share nothing, so a collective that groups devices of different members
moves one member's data to another member's device: a wasted transfer at best, and at worst
(inside a loop) a point where every device waits for the others. A member that spans several
devices (``'data'`` / ``'model'`` axes) needs collectives among its own devices; those are fine.

:func:`collectives` counts the collectives in a compiled program's HLO; with
``across_members=True`` it counts only those whose device groups hold devices of more than one
member. The devices of a group come from the op's ``replica_groups`` (listed, XLA's iota form
``[G,S]<=[dims]T(perm)``, or its mesh form ``mesh['a'=4,'b'=2] {'b'}``) or
``source_target_pairs``; they are partition ids, which index the program's mesh devices in
order. Groups in any other form count as one group of all devices (so as crossing members).

Example:
  >>> import jax, jax.numpy as jnp, ensemble
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = ensemble.make_mesh(4, devices=jax.devices()[:8])  # 2 devices per member
  >>> x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("ensemble", "data")))
  >>> per_member = jax.jit(lambda x: x.sum(axis=1)).lower(x).compile()
  >>> collectives(per_member), collectives(per_member, across_members=True)
  ({'all-reduce': 1}, {})
  >>> collectives(jax.jit(lambda x: x.sum()).lower(x).compile(), across_members=True)
  {'all-reduce': 1}
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ensemble._mesh import MEMBER_AXIS

_KINDS = (
    "all-gather|all-reduce|reduce-scatter|ragged-all-to-all|all-to-all|collective-permute"
    "|collective-broadcast"
)
_OP = re.compile(rf"\s({_KINDS})(?:-start)?\(")
_LISTED = re.compile(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,\s]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_AXES = re.compile(
    r"replica_groups=mesh\[((?:'\w+'=\d+,?)*)\]"
    r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"  # the mesh's devices, as an iota
    r" \{((?:'\w+',?\s*)*)\}(?:[,\s]|$)"  # the op's last field ends the line
)


def collectives(compiled: Any, across_members: bool = False) -> dict[str, int]:
    """How many of each cross-device collective a compiled program holds: the places in its HLO,
    not executions (one inside a loop counts once; what matters here is whether there are any).

    ``across_members``: count only the collectives that group devices of different members
    (along the program's mesh axis ``'ensemble'``); an ensemble program should have none. A
    member's own devices may share work (collectives within a member are not counted).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> collectives(jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile())
      {}
    """
    if isinstance(compiled, jax.stages.Lowered):
        compiled = compiled.compile()
    if not isinstance(compiled, jax.stages.Compiled):
        raise TypeError(
            f"collectives takes a lowered or compiled program, got {type(compiled).__name__}: "
            "pass jax.jit(f).lower(*args) (or its .compile()), e.g. step.lower(...) of a train "
            "step."
        )
    member_of = _member_blocks(compiled) if across_members else None
    counts: dict[str, int] = {}
    for line in compiled.as_text().splitlines():
        found = _OP.search(line)
        if found is None:
            continue
        if member_of is not None and not _crosses(line, member_of):
            continue
        counts[found.group(1)] = counts.get(found.group(1), 0) + 1
    return counts


def _member_blocks(compiled: Any) -> np.ndarray:
    """The member block (position on the ``'ensemble'`` axis) of each partition id."""
    shardings = jax.tree_util.tree_leaves((compiled.input_shardings, compiled.output_shardings))
    named = [s for s in shardings if isinstance(s, NamedSharding)]
    meshes = {s.mesh for s in named if isinstance(s.mesh, Mesh)}
    if len(meshes) != 1 or MEMBER_AXIS not in next(iter(meshes)).axis_names:
        raise ValueError(
            "across_members=True needs a program whose inputs or outputs are laid out on one "
            f"ensemble mesh (NamedShardings with a '{MEMBER_AXIS}' axis); found "
            f"{len(meshes)} meshes"
        )
    mesh = meshes.pop()
    ids = np.arange(mesh.devices.size)
    return np.unravel_index(ids, mesh.devices.shape)[mesh.axis_names.index(MEMBER_AXIS)]


def _crosses(line: str, member_of: np.ndarray) -> bool:
    groups = _groups(line, len(member_of))
    return any(len({int(member_of[i]) for i in group}) > 1 for group in groups)


def _groups(line: str, partitions: int) -> list[list[int]]:
    """The op's device groups as partition ids (no groups given: one group of all)."""
    iota = _IOTA.search(line)
    if iota is not None:
        shape = [int(x) for x in iota.group(1).split(",")]
        dims = [int(x) for x in iota.group(2).split(",")]
        if int(np.prod(dims)) != partitions:
            return [list(range(partitions))]
        ids = np.arange(partitions).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    axes = _AXES.search(line)
    if axes is not None:  # mesh['a'=4,'b'=2] {'b'}: a group per index of the axes not listed
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", axes.group(1)))
        within = re.findall(r"'(\w+)'", axes.group(4))
        names, shape = list(sizes), [int(v) for v in sizes.values()]
        if int(np.prod(shape)) != partitions or not set(within) <= set(names):
            return [list(range(partitions))]
        ids = np.arange(partitions)
        if axes.group(2):  # device_ids=([2,3]T(1,0)): iota(2, 3) transposed, laid on the mesh
            dims = [int(x) for x in axes.group(2).split(",")]
            if int(np.prod(dims)) != partitions:
                return [list(range(partitions))]
            ids = ids.reshape(dims)
            if axes.group(3):
                ids = ids.transpose([int(x) for x in axes.group(3).split(",")])
        ids = ids.reshape(shape)
        order = [names.index(a) for a in names if a not in within]
        order += [names.index(a) for a in within]
        size = int(np.prod([int(sizes[a]) for a in within]))
        return ids.transpose(order).reshape(-1, size).tolist()
    listed = _LISTED.search(line)
    if listed is not None and listed.group(1):
        groups = re.findall(r"\{([\d,\s]*)\}", listed.group(1))
        return [[int(x) for x in g.split(",") if x.strip()] for g in groups]
    return [list(range(partitions))]
