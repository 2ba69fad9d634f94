"""Exported members: one self-contained directory per PPO agent, loadable without the trainer.

:func:`export_members` writes, for each member ``i``, ``<directory>/member_<i>/`` with

- ``member.json``: ``{"format": "rollout.ppo.member", "version": 4, "member": i, "env": ...,
  "gymnasium_id": ..., "env_steps": ..., "network": {...}, "obs_norm": {...}, "action": {...},
  "hparams": {...}, "config": {...}, "env_from_config": ..., "run_id": ...}``. ``run_id`` is
  the training run's (its ``run.json``) for :func:`export_run` (the CLI), ``null`` for
  :func:`export_members` / :func:`export_from_state`, which take a state and know no run;
  readers compare it only where both members have one. ``gymnasium_id`` is what
  ``gymnasium.make`` takes for the env (``null`` where gymnasium has no such env);
  ``env_from_config`` is false for a member trained on an env object that its config does not
  make (``Learner(config, env=...)``), which ``evaluate`` then refuses (absent: true).
  ``network`` holds ``kind``, ``obs_shape``, ``action_dim``, ``discrete``,
  ``action_groups`` and ``activation``, and per kind:

  - ``"ActorCritic"`` (vector observations): ``hidden`` (layer widths); ``activation`` "tanh".
  - ``"ImageActorCritic"`` (image observations): ``convs`` (``[features, kernel size,
    stride]`` per VALID conv), ``dense`` (width), ``channels_first`` and ``obs_scale``;
    ``activation`` "relu".

  ``obs_norm`` holds ``enabled``, ``clip`` (10) and ``epsilon`` (1e-8), training's; ``action``
  holds the continuous action box ``low`` / ``high``: one number per action dimension,
  ``null`` for an infinite bound (no clipping on that side of that dimension); the whole entry
  is ``null`` for a discrete action or a side unbounded in every dimension; ``start`` holds a
  discrete action's first action, one integer per categorical (gymnasium's ``Discrete(n,
  start=k)``: ``[k]``; a MultiDiscrete's ``start`` per element; ``[0]`` for most envs), and
  is ``null`` for a continuous action. (``act`` computes in int32: for actions beyond it,
  it says to add ``start`` to ``policy_action`` in int64.)
- ``params.npz``: the network's arrays, named ``<layer>/<kernel|bias>``, plus ``log_std`` for
  continuous actions. ``ActorCritic``: ``actor_0``, ``actor_1``, ..., ``actor_out``,
  ``critic_0``, ..., ``critic_out``. ``ImageActorCritic``: ``convs_0``, ``convs_1``, ...
  (kernels ``[k, k, in, out]``), ``dense``, ``actor_out``, ``critic_out``. A Dense layer is
  ``x @ kernel + bias``.
- ``obs_norm.npz``: ``mean``, ``var`` (observation shape) and ``count`` of the running
  observation statistics.

``member.json`` is removed first and written last (whole), so a ``member_<i>`` without one is an
export cut short. Readers refuse it in one line, as they do a ``member.json`` at odds with the
format, with itself or with the arrays (:class:`NotAnExport`, naming the field).

The policy is: ``z = clip((obs - mean) / sqrt(var + epsilon), -clip, clip)`` when
``obs_norm.enabled`` (else ``z = obs``); then

- ``ActorCritic``: ``h = activation(h @ kernel + bias)`` through the actor layers, ``head = h @
  actor_out.kernel + actor_out.bias``;
- ``ImageActorCritic``: ``h = z * obs_scale``, transposed ``[C, H, W] -> [H, W, C]`` when
  ``channels_first``; ``h = relu(conv(h) + bias)`` per conv (VALID padding, the given stride,
  cross-correlation as in every deep-learning library); flattened in ``(H, W, C)`` order;
  ``h = relu(h @ dense.kernel + dense.bias)``; ``head = h @ actor_out.kernel + actor_out.bias``.

The deterministic action is ``argmax(head) + start`` (discrete: the argmax picks an index
0..n-1, the env's actions are ``start``..``start + n - 1``) or ``clip(head, low, high)``
(continuous: the mean of the Gaussian). A MultiDiscrete action space's ``nvec`` is
``action_groups`` (``[]`` otherwise): the head is then that many categoricals side by side
(``action_dim`` is their sum), and the action is one argmax per group plus that element's
``start``, an int vector of ``len(action_groups)``. Versions 1 (vector observations only), 2
(without ``action_groups``: one categorical) and 3 (without ``action.start``: read as 0; their
``act`` gave the index, which the env's action is only where the space starts at 0) are still
read.

Each member is taken from its own shards (``ensemble.member``): exporting member ``i`` copies
member ``i``'s arrays to the host and nothing else. With several processes, each process writes
the members its devices hold.

Example:
  >>> import jax, numpy as np, tempfile
  >>> from rollout.ppo import Learner, PPOConfig
  >>> from rollout.ppo.export import export_members, load_member
  >>> learner = Learner(PPOConfig.for_env("cartpole", members=jax.device_count(),
  ...                                     total_steps=512))
  >>> out = tempfile.mkdtemp()
  >>> paths = export_members(learner, learner.init(), out, members=[0, 3])
  >>> [p.name for p in paths]
  ['member_0', 'member_3']
  >>> act = jax.jit(load_member(paths[1]))
  >>> act(np.zeros((5, 4), np.float32)).shape
  (5,)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from rollout._devices import available_cores
from rollout.ppo._networks import argmax_action, split_groups

__all__ = [
    "FORMAT",
    "READABLE_VERSIONS",
    "VERSION",
    "ExportedMember",
    "NotAnExport",
    "argmax_action",
    "export_command",
    "export_from_state",
    "export_members",
    "export_run",
    "gymnasium_id",
    "load_member",
    "main",
    "member_arrays",
    "member_dirs",
    "network_meta",
    "read_member",
]

FORMAT = "rollout.ppo.member"
VERSION = 4
#: Format versions this module reads.
READABLE_VERSIONS = (1, 2, 3, 4)
#: The learner's observation normalisation: clip and epsilon of ``Learner._normalize``.
OBS_CLIP, OBS_EPSILON = 10.0, 1e-8
_GYMNASIUM_IDS = {"cartpole": "CartPole-v1", "pendulum": "Pendulum-v1"}
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
}


class NotAnExport(ValueError):
    """The directory is not a member written by :func:`export_members`."""


# ---------------------------------------------------------------------- writing


def export_members(
    learner: Any,
    state: Any,
    directory: str | os.PathLike,
    members: Sequence[int] | None = None,
) -> list[Path]:
    """Writes members of a live train state as self-contained directories; returns their paths.

    Args:
      learner: the :class:`~rollout.ppo.Learner` that made ``state``.
      state: its :class:`~rollout.ppo.TrainState` (not modified, not donated).
      directory: created if needed; member ``i`` goes to ``directory/member_<i>``.
      members: which members (default: all). With several processes only the members held by
        this process's devices are written (and returned).
    """
    return _export_learners(learner, state, directory, members)


def _export_learners(learner, state, directory, members, run_id: str | None = None) -> list[Path]:
    return _export(
        learner.config, learner.spec, learner.normalize_obs, state, directory, members,
        learner.env_from_config, run_id,
    )  # fmt: skip


def export_from_state(
    config: Any,
    state: Any,
    directory: str | os.PathLike,
    members: Sequence[int] | None = None,
) -> list[Path]:
    """:func:`export_members` from a :class:`~rollout.ppo.PPOConfig` and a train state alone.

    For a state restored from a checkpoint, without building a learner (and its programs).
    """
    from rollout.ppo import _env as envlib

    spec = envlib.spec_of(envlib.make_env(config.env, config.make_kwargs()))
    normalize = envlib.normalize_obs(config, spec)
    return _export(config, spec, normalize, state, directory, members, True)


def _chosen(members: Sequence[int] | None, n: int, directory: str | os.PathLike) -> list[int]:
    """The members to export, checked (range, repeats) with the destination, before any work."""
    chosen = list(range(n)) if members is None else [int(i) for i in members]
    for i in chosen:
        if not 0 <= i < n:
            raise IndexError(f"member {i} out of range for members={n}.")
    repeated = sorted({i for i in chosen if chosen.count(i) > 1})
    if repeated:
        raise ValueError(f"members {repeated} are given more than once; list each member once.")
    if Path(directory).exists() and not Path(directory).is_dir():
        raise ValueError(f"{directory} is a file; export to a directory (another --to).")
    return chosen


def _other_run_member(
    export: Path, config: dict[str, Any], run_id: str | None = None
) -> Path | None:
    """The first member directory in ``export`` exported from a run of another config or
    another ``run_id`` (where both have one; None if all are this run's); members whose
    ``member.json`` cannot be read, or that have none (an interrupted export, which exporting
    again repairs), are not counted. Fields a resume may extend (``--total-steps``) do not
    make another run: an extended run re-exports in place."""
    from rollout.ppo._checkpoint import EXTENDABLE

    fixed = lambda c: {k: v for k, v in c.items() if k not in EXTENDABLE}
    for meta_file in sorted(export.glob("member_*/member.json")):
        try:
            meta = json.loads(meta_file.read_text())
            same = fixed(meta.get("config")) == fixed(config)
            same = same and same_run_id(meta.get("run_id"), run_id)
        except (OSError, ValueError, AttributeError):
            continue  # not readable as an export: nothing of a run to protect
        if not same:
            return meta_file.parent
    return None


def same_run_id(a: Any, b: Any) -> bool:
    """Two members' ``run_id``: the same run unless both are known and differ (an export of a
    live state, or one written before the field existed, has none)."""
    return a is None or b is None or a == b


def _check_same_run(root: Path, config: Any, run_id: str | None) -> None:
    """Refuses to write into an export of another run: its members would be replaced, and the
    rest then mixed with this run's into one "ensemble"."""
    other = _other_run_member(root, config.to_dict(), run_id)
    if other is not None:
        raise ValueError(
            f"{root} holds members of another run ({other.name}); export to an empty directory "
            "(another --to), or remove that export first."
        )


def _check_same_checkpoint(root: Path, chosen: list[int], env_steps: int) -> None:
    """Refuses to add members of this state beside members, kept in ``root``, of another
    checkpoint of the same run: evaluate would refuse the mix (an ensemble of one time)."""
    for meta_file in sorted(root.glob("member_*/member.json")):
        try:
            meta = json.loads(meta_file.read_text())
            kept, steps = int(meta["member"]) not in chosen, meta["env_steps"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not readable as a member: nothing to mix with
        if kept and steps != env_steps:
            raise ValueError(
                f"{root} holds {meta_file.parent.name} of another checkpoint of this run (env "
                f"steps {steps}, this one {env_steps}); exporting members {chosen} beside it "
                "would mix checkpoints: export every member (no --members), or to an empty "
                "directory (another --to)."
            )


def _export(
    config, spec, normalize_obs, state, directory, members, from_config, run_id=None
) -> list[Path]:
    n = config.members
    chosen = _chosen(members, n, directory)
    root = Path(directory)
    _check_same_run(root, config, run_id)
    env_steps = int(jax.device_get(state.update)) * config.batch_size
    _check_same_checkpoint(root, chosen, env_steps)
    root.mkdir(parents=True, exist_ok=True)
    network = network_meta(config, spec)
    paths = []
    for i in chosen:
        if not _held_here(state.members.params, i, n):
            continue  # another process holds this member and writes it
        params, stats, hparams = member_arrays(state, i)
        path = root / f"member_{i}"
        path.mkdir(exist_ok=True)
        # member.json goes first and comes back last: an export cut short leaves a directory
        # without one (refused as partial), never old metadata beside new arrays.
        (path / "member.json").unlink(missing_ok=True)
        flat = _flatten(jax.device_get(params))
        _check_layout(flat, network)
        np.savez(path / "params.npz", **flat)
        stats = jax.device_get(stats)
        np.savez(
            path / "obs_norm.npz",
            mean=np.asarray(stats.mean, np.float32),
            var=np.asarray(stats.var, np.float32),
            count=np.asarray(stats.count, np.float32),
        )
        hparams = jax.device_get(hparams)
        meta = _metadata(config, spec, network, normalize_obs, i, env_steps, hparams)
        meta["env_from_config"] = from_config  # false: evaluate cannot make the env it knew
        meta["run_id"] = run_id
        tmp = path / "member.json.tmp"  # whole or absent, never a truncated member.json
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, path / "member.json")
        paths.append(path)
    return paths


def member_arrays(state: Any, i: int) -> tuple[Any, Any, Any]:
    """Member ``i``'s params, observation statistics and hyperparameters, still on its devices.

    Assembled from the shards that hold member ``i`` (``ensemble.member``): no other member's
    data moves.
    """
    import ensemble

    ms = state.members
    return (
        ensemble.member(ms.params, i),
        ensemble.member(ms.obs_stats, i),
        ensemble.member(ms.hparams, i),
    )


def _held_here(tree: Any, i: int, n: int) -> bool:
    leaf = jax.tree.leaves(tree)[0]
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
        return True
    for shard in leaf.addressable_shards:
        rows = shard.index[0]
        if (rows.start or 0) <= i < (n if rows.stop is None else rows.stop):
            return True
    return False


def _flatten(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    flat: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "/"))
        else:
            flat[name] = np.asarray(value, np.float32)
    return flat


def network_meta(config: Any, spec: Any) -> dict[str, Any]:
    """The ``network`` entry of ``member.json`` for the learner's network on ``spec``."""
    from rollout.ppo import _networks as nets

    net = nets.make_network(spec, config.hidden)
    common = {
        "obs_shape": [int(s) for s in spec.obs_shape],
        "action_dim": int(spec.action_dim),
        "discrete": bool(spec.discrete),
        "action_groups": [int(g) for g in spec.action_groups],
    }
    if isinstance(net, nets.ActorCritic):
        hidden = [int(h) for h in net.hidden]
        return {"kind": "ActorCritic", **common, "hidden": hidden, "activation": "tanh"}
    convs, dense = nets.TORSOS[net.torso]
    return {
        "kind": "ImageActorCritic",
        **common,
        "convs": [list(c) for c in convs],
        "dense": dense,
        "channels_first": bool(net.channels_first),
        "obs_scale": float(net.obs_scale),
        "activation": "relu",
    }


def _layer_names(network: dict[str, Any]) -> list[str]:
    if network["kind"] == "ActorCritic":
        towers = [f"{t}_{k}" for t in ("actor", "critic") for k in range(len(network["hidden"]))]
    else:
        towers = [*(f"convs_{k}" for k in range(len(network["convs"]))), "dense"]
    return [*towers, "actor_out", "critic_out"]


def _check_layout(flat: dict[str, np.ndarray], network: dict[str, Any]) -> None:
    """The arrays must be the documented layout; a changed network must not export silently."""
    want = {f"{layer}/{p}" for layer in _layer_names(network) for p in ("kernel", "bias")}
    if not network["discrete"]:
        want.add("log_std")
    if set(flat) != want:
        raise ValueError(
            f"the actor-critic's parameters {sorted(flat)} are not the documented export "
            f"layout {sorted(want)}; update rollout.ppo.export for the new network."
        )


def gymnasium_id(env: str) -> str | None:
    """The id ``gymnasium.make`` takes for ``env``, or None: ``'gymnasium:<id>'`` -> ``<id>``
    (``module:EnvId`` included); the built-in CartPole and Pendulum ports -> gymnasium's own."""
    if env.startswith("gymnasium:"):
        return env.removeprefix("gymnasium:")
    return _GYMNASIUM_IDS.get(env)


def action_box(spec: Any) -> dict[str, list[float | None] | list[int] | None]:
    """``member.json``'s ``action`` of an env's spec: its box's bounds (null: unbounded, as JSON
    has no infinity; both null for discrete actions) and a discrete action's ``start`` (one per
    categorical; null for continuous actions)."""

    def bounds(a: Any) -> list[float | None] | None:
        if a is None or spec.discrete:
            return None
        return [float(v) if np.isfinite(v) else None for v in np.asarray(a, np.float32).ravel()]

    heads = max(1, len(spec.action_groups))
    start = [int(k) for k in spec.action_start] or [0] * heads
    return {
        "low": bounds(spec.action_low),
        "high": bounds(spec.action_high),
        "start": start if spec.discrete else None,
    }


def _metadata(config, spec, network, normalize_obs, i, env_steps, hparams) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "member": i,
        "env": config.env,
        "gymnasium_id": gymnasium_id(config.env),
        "env_steps": env_steps,
        "network": network,
        "obs_norm": {"enabled": bool(normalize_obs), "clip": OBS_CLIP, "epsilon": OBS_EPSILON},
        "action": action_box(spec),
        "hparams": {k: float(v) for k, v in hparams.items()},
        "config": config.to_dict(),
    }


# ---------------------------------------------------------------------- reading


def _along(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` broadcast to ``like``'s shape explicitly: the maths here also runs under
    ``jax_numpy_rank_promotion='raise'``, which refuses implicit rank broadcasting."""
    return jnp.broadcast_to(x, like.shape)


def _bound(values: list[float | None] | None, sign: int) -> jax.Array | None:
    """One side of the action box as stored (``null``: infinite), for ``jnp.clip``."""
    if values is None:
        return None
    return jnp.asarray([sign * np.inf if v is None else v for v in values], jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class ExportedMember:
    """One exported member, its arrays on one device. ``act`` is the deterministic policy."""

    meta: dict[str, Any]
    params: dict[str, jax.Array]
    obs_mean: jax.Array
    obs_var: jax.Array
    #: The directory it was read from (None: built in memory).
    path: Path | None = None

    @property
    def discrete(self) -> bool:
        return bool(self.meta["network"]["discrete"])

    @property
    def action_groups(self) -> tuple[int, ...]:
        """A MultiDiscrete action's ``nvec``; ``()`` for one categorical or a Box."""
        return tuple(_groups_of(self.meta))

    @property
    def action_start(self) -> tuple[int, ...]:
        """A discrete action's first action per categorical (``action.start``; 0 in format
        versions before 4); ``()`` for a Box."""
        if not self.discrete:
            return ()
        return tuple(_start_of(self.meta))

    def normalize(self, obs: ArrayLike) -> jax.Array:
        norm = self.meta["obs_norm"]
        obs = jnp.asarray(obs, jnp.float32)
        if not norm["enabled"]:
            return obs
        mean, var = _along(self.obs_mean, obs), _along(self.obs_var, obs)
        z = (obs - mean) / jnp.sqrt(var + norm["epsilon"])
        return jnp.clip(z, -norm["clip"], norm["clip"])

    def head(self, obs: ArrayLike) -> jax.Array:
        """The policy head for raw observations ``[..., *obs_shape]``: logits, or the mean."""
        network = self.meta["network"]
        act_fn = _ACTIVATIONS[network["activation"]]

        def dense(h: jax.Array, name: str) -> jax.Array:
            h = h @ self.params[f"{name}/kernel"]
            return h + _along(self.params[f"{name}/bias"], h)

        h = self.normalize(obs)
        if network["kind"] == "ImageActorCritic":
            h = self._conv_torso(h, act_fn)
            h = act_fn(dense(h, "dense"))
        else:
            for k in range(len(network["hidden"])):
                h = act_fn(dense(h, f"actor_{k}"))
        return dense(h, "actor_out")

    def _conv_torso(self, z: jax.Array, act_fn: Callable) -> jax.Array:
        """``ImageActorCritic``'s convs, flattened: ``[..., *obs_shape] -> [..., features]``."""
        network = self.meta["network"]
        lead = z.shape[:-3]
        h = z.reshape(-1, *z.shape[-3:]) * network["obs_scale"]
        if network["channels_first"]:
            h = jnp.transpose(h, (0, 2, 3, 1))
        for k, (_, _, stride) in enumerate(network["convs"]):
            h = jax.lax.conv_general_dilated(
                h, self.params[f"convs_{k}/kernel"], (stride, stride), "VALID",
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
            )  # fmt: skip
            h = act_fn(h + _along(self.params[f"convs_{k}/bias"], h))
        return h.reshape(*lead, -1)

    def probs(self, obs: ArrayLike) -> jax.Array:
        """Discrete only: the action probabilities ``softmax(logits)`` (per group of
        :attr:`action_groups`, side by side)."""
        return jnp.concatenate(
            [jax.nn.softmax(x, axis=-1) for x in split_groups(self.head(obs), self.action_groups)],
            axis=-1,
        )

    def clip_action(self, action: jax.Array) -> jax.Array:
        """A continuous action clipped into the env's box (as the learner's env step does)."""
        low, high = (_bound(self.meta["action"][k], s) for k, s in (("low", -1), ("high", 1)))
        low, high = (None if b is None else _along(b, action) for b in (low, high))
        return jnp.clip(action, low, high)  # None: unbounded on that side

    def act(self, obs: ArrayLike) -> jax.Array:
        """Deterministic actions for raw observations, as the env's ``step`` takes them: the
        argmax plus the space's ``start`` (int32), or the clipped mean."""
        action = self.policy_action(obs)
        if self.discrete and any(self.action_start):
            self._check_int32()
            start = jnp.asarray(self.action_start if self.action_groups else self.action_start[0])
            return action + _along(start.astype(action.dtype), action)
        return action

    def _check_int32(self) -> None:
        """The env's actions must be int32 values, which ``act`` computes in (JAX's default)."""
        sizes = self.action_groups or (self.meta["network"]["action_dim"],)
        low = min(self.action_start)
        high = max(k + n - 1 for k, n in zip(self.action_start, sizes))
        if low < -(2**31) or high >= 2**31:
            raise ValueError(
                f"this member's env takes actions {low}..{high}, beyond the int32 that act "
                "computes in: add action.start to policy_action(obs) in int64 yourself "
                "(np.asarray(member.policy_action(obs), np.int64) + start)."
            )

    def policy_action(self, obs: ArrayLike) -> jax.Array:
        """:meth:`act` as the learner's policy picks it: discrete indices from 0 (int32; the
        env's action less its ``start``, as training's envs take them), or the clipped mean."""
        head = self.head(obs)
        if self.discrete:
            return argmax_action(head, self.action_groups)
        return self.clip_action(head)


def export_command(export: Path) -> str:
    """The command that writes the export ``export`` again: ``python -m rollout.ppo.export
    RUN`` where it is a run's default ``RUN/export``, else with ``RUN_DIR`` and ``--to``."""
    q = lambda p: shlex.quote(str(p))  # a command to paste into a shell
    if export.name == "export" and (export.parent / "run.json").is_file():
        return f"python -m rollout.ppo.export {q(export.parent)}"
    return f"python -m rollout.ppo.export RUN_DIR --to {q(export)}"


def _partial(member: Path, others: int = 0) -> str:
    """Says a member directory has no ``member.json`` (``others``: more such directories)."""
    also = f" (and {others} more member_<i> director{'ies' if others > 1 else 'y'})"
    return (
        f"{member}{also if others else ''} has no member.json: an interrupted or partial "
        f"export? export again ({export_command(member.parent)}) or remove it."
    )


def _edited(meta_path: Path, what: str) -> NotAnExport:
    """A ``member.json`` at odds with the format, itself, its arrays or its env: one line
    naming the file and the field, and how to get a good one."""
    return NotAnExport(
        f"{meta_path}: {what}; export the member again ({export_command(meta_path.parent.parent)})."
    )


def _show(value: Any) -> str:
    text = json.dumps(value)  # as it reads in the file (true, null)
    return text if len(text) <= 40 else text[:37] + "..."


_MISSING = object()
_KINDS = ("ActorCritic", "ImageActorCritic")
_num = lambda v: isinstance(v, int | float) and not isinstance(v, bool)
_int = lambda v, low: isinstance(v, int) and not isinstance(v, bool) and v >= low
#: A list of positive integers (of a length in ``n``, if given).
_dims = lambda v, n=None: (
    isinstance(v, list) and (n is None or len(v) in n) and all(_int(d, 1) for d in v)
)
_box = lambda v: v is None or (isinstance(v, list) and all(x is None or _num(x) for x in v))
_object = (lambda v: isinstance(v, dict), "an object")
#: member.json's fields: (dotted name, check, what it must be), parents before their fields.
_FIELDS = (
    ("member", lambda v: _int(v, 0), "a member index (an integer >= 0)"),
    ("env", lambda v: isinstance(v, str) and v != "", "an env name"),
    ("gymnasium_id", lambda v: v is None or isinstance(v, str), "a gymnasium id or null"),
    ("env_steps", lambda v: _int(v, 0), "an integer >= 0"),
    ("network", *_object),
    ("network.kind", lambda v: v in _KINDS, " or ".join(map(repr, _KINDS))),
    ("network.action_dim", lambda v: _int(v, 1), "a positive integer"),
    ("network.discrete", lambda v: isinstance(v, bool), "true or false"),
    ("obs_norm", *_object),
    ("obs_norm.enabled", lambda v: isinstance(v, bool), "true or false"),
    # Training's own constants: another value describes a policy that was never trained.
    ("obs_norm.clip", lambda v: _num(v) and v == OBS_CLIP, f"{OBS_CLIP:g} (training's clip)"),
    (
        "obs_norm.epsilon",
        lambda v: _num(v) and v == OBS_EPSILON,
        f"{OBS_EPSILON:g} (training's epsilon)",
    ),
    ("action", *_object),
    ("action.low", _box, "null or a list of numbers (null: unbounded)"),
    ("action.high", _box, "null or a list of numbers (null: unbounded)"),
    (
        "hparams",
        lambda v: isinstance(v, dict) and all(map(_num, v.values())),
        "an object of numbers",
    ),
    ("config", *_object),
)
_GROUPS_FIELD = (
    "network.action_groups",
    lambda v: isinstance(v, list) and all(_int(g, 1) for g in v),
    "a list of positive integers ([] but for a MultiDiscrete action)",
)
_START_FIELD = (
    "action.start",
    lambda v: v is None or (isinstance(v, list) and v != [] and all(_int(k, -np.inf) for k in v)),
    "null or a list of integers (a discrete action's first action per categorical)",
)
#: The fields of each network kind (its activation is part of the format).
_NETWORK_FIELDS = {
    "ActorCritic": (
        ("network.obs_shape", lambda v: _dims(v, (1,)), "[D] (vector observations)"),
        ("network.hidden", lambda v: _dims(v), "a list of layer widths"),
        ("network.activation", lambda v: v == "tanh", '"tanh" (ActorCritic\'s)'),
    ),
    "ImageActorCritic": (
        ("network.obs_shape", lambda v: _dims(v, (3,)), "[H, W, C] or [C, H, W]"),
        (
            "network.convs",
            lambda v: isinstance(v, list) and v and all(_dims(c, (3,)) for c in v),
            "a list of [features, kernel size, stride]",
        ),
        ("network.dense", lambda v: _int(v, 1), "a positive integer"),
        ("network.channels_first", lambda v: isinstance(v, bool), "true or false"),
        ("network.obs_scale", lambda v: _num(v) and v > 0, "a positive number"),
        ("network.activation", lambda v: v == "relu", '"relu" (ImageActorCritic\'s)'),
    ),
}


def _field(meta: dict[str, Any], name: str) -> Any:
    for key in name.split("."):
        meta = meta.get(key, _MISSING) if isinstance(meta, dict) else _MISSING
    return meta


def _check_fields(meta_path: Path, meta: Any) -> None:
    """The format, a readable version, then every field present and of its kind."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        what = "not an object" if not isinstance(meta, dict) else _show(meta.get("format"))
        raise _edited(meta_path, f"not a {FORMAT} file (field 'format' is {what})")
    version = meta.get("version", _MISSING)
    if not _int(version, 0):
        shown = "missing" if version is _MISSING else _show(version)
        raise _edited(meta_path, f"field 'version' is {shown}, not a format version number")
    if version not in READABLE_VERSIONS:
        raise NotAnExport(
            f"{meta_path} has format version {version}; this version of the library reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}: read it with the version that wrote "
            f"it, or export the member again ({export_command(meta_path.parent.parent)})."
        )
    kind = _field(meta, "network.kind")  # (checked first in the loop; may be any JSON value)
    per_kind = _NETWORK_FIELDS.get(kind, ()) if isinstance(kind, str) else ()
    groups = (_GROUPS_FIELD,) if version >= 3 else ()  # (versions 1, 2: one categorical)
    start = (_START_FIELD,) if version >= 4 else ()  # (versions 1-3: actions from 0)
    for name, ok, what in (*_FIELDS, *per_kind, *groups, *start):
        value = _field(meta, name)
        if value is _MISSING:
            raise _edited(meta_path, f"field {name!r} is missing")
        if not ok(value):
            raise _edited(meta_path, f"field {name!r} is {_show(value)}, not {what}")


def _check_agreement(meta_path: Path, meta: dict[str, Any]) -> None:
    """Fields that must agree with each other (a hand edit of one of them would run another
    env, or clip actions to a box of the wrong size)."""
    from rollout.ppo._config import PPOConfig

    env, network = meta["env"], meta["network"]
    try:
        config = PPOConfig.from_dict(meta["config"])
        config.make_kwargs()
    except (TypeError, ValueError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise _edited(meta_path, f"field 'config' is not a training config ({why})") from None
    if config.env != env:
        raise _edited(
            meta_path, f"field 'env' is {_show(env)} but field 'config.env' is {_show(config.env)}"
        )
    if meta["gymnasium_id"] not in (None, gymnasium_id(env)):
        raise _edited(
            meta_path,
            f"field 'gymnasium_id' is {_show(meta['gymnasium_id'])} but env {_show(env)} is "
            f"gymnasium's {_show(gymnasium_id(env))}",
        )
    groups = _groups_of(meta)
    if groups and (not network["discrete"] or sum(groups) != network["action_dim"]):
        what = f"adds up to {sum(groups)}" if network["discrete"] else "is set"
        raise _edited(
            meta_path,
            f"field 'network.action_groups' {what}, but 'network.action_dim' is "
            f"{network['action_dim']} and 'network.discrete' {_show(network['discrete'])} (a "
            "MultiDiscrete's groups add up to the discrete action_dim)",
        )
    for side in ("low", "high"):
        box, n = meta["action"][side], network["action_dim"]
        if box is not None and network["discrete"]:
            what = "is a box, but 'network.discrete' is true (discrete actions have none)"
            raise _edited(meta_path, f"field 'action.{side}' {what}")
        if box is not None and len(box) != n:
            what = f"has {len(box)} bounds but 'network.action_dim' is {n}"
            raise _edited(meta_path, f"field 'action.{side}' {what}")
    if meta["member"] >= config.members:
        what = f"is {meta['member']}, but 'config.members' is {config.members}"
        raise _edited(meta_path, f"field 'member' {what} (a member renamed or copied by hand?)")


def _check_start(meta_path: Path, meta: dict[str, Any]) -> None:
    """``action.start``: one per categorical of a discrete action, null for a continuous one."""
    if meta["version"] < 4:
        return
    start, discrete = meta["action"]["start"], meta["network"]["discrete"]
    heads = max(1, len(_groups_of(meta)))
    if not discrete and start is not None:
        what = "is a list, but 'network.discrete' is false (a continuous action has none)"
        raise _edited(meta_path, f"field 'action.start' {what}")
    if discrete and (start is None or len(start) != heads):
        what = "null" if start is None else f"{len(start)} integers"
        raise _edited(
            meta_path,
            f"field 'action.start' is {what}, but the discrete action has {heads} categorical(s) "
            "(one start each)",
        )


def _start_of(meta: dict[str, Any]) -> list[int]:
    """``action.start`` from version 4 on (versions 1-3: every categorical from 0)."""
    if meta["version"] >= 4:
        return meta["action"]["start"]
    return [0] * max(1, len(_groups_of(meta)))


def _groups_of(meta: dict[str, Any]) -> list[int]:
    """``network.action_groups`` from version 3 on; versions 1 and 2 had one categorical."""
    return meta["network"].get("action_groups", []) if meta["version"] >= 3 else []


def _check_obs_norm(meta_path: Path, meta: dict[str, Any]) -> None:
    """``obs_norm.enabled`` is what training did: ``config.normalize_obs``, or by default
    for continuous actions on vector observations (``rollout.ppo._env.normalize_obs``)."""
    norm, network = meta["config"].get("normalize_obs"), meta["network"]
    if norm is not None and not isinstance(norm, bool):
        raise _edited(meta_path, f"field 'config.normalize_obs' is {_show(norm)}, not a bool")
    by = "by its 'config.normalize_obs'"
    if norm is None:
        norm = not network["discrete"] and len(network["obs_shape"]) == 1
        by = "by default for its 'network' (only continuous actions on vectors are)"
    if meta["obs_norm"]["enabled"] != norm:
        did = "normalised" if norm else "did not normalise"
        enabled = _show(meta["obs_norm"]["enabled"])
        raise _edited(
            meta_path, f"field 'obs_norm.enabled' is {enabled} but training {did} observations {by}"
        )


def _array_shapes(network: dict[str, Any]) -> dict[str, tuple[tuple[int, str], ...]]:
    """The arrays of params.npz for ``network``: per axis, its size and the field setting it."""
    shapes: dict[str, tuple[tuple[int, str], ...]] = {}
    obs, convs = network["obs_shape"], "network.convs"

    def dense(name: str, fan_in: tuple[int, str], width: tuple[int, str]) -> None:
        shapes[f"{name}/kernel"], shapes[f"{name}/bias"] = (fan_in, width), (width,)

    if network["kind"] == "ActorCritic":
        for tower in ("actor", "critic"):
            top = (obs[0], "network.obs_shape")
            for k, width in enumerate(network["hidden"]):
                dense(f"{tower}_{k}", top, (width, "network.hidden"))
                top = (width, "network.hidden")
    else:
        channels, rows, cols = obs if network["channels_first"] else (obs[2], *obs[:2])
        top = (channels, "network.obs_shape")
        for k, (features, size, stride) in enumerate(network["convs"]):
            out = (features, convs)
            shapes[f"convs_{k}/kernel"] = ((size, convs), (size, convs), top, out)
            shapes[f"convs_{k}/bias"], top = (out,), out
            rows, cols = (rows - size) // stride + 1, (cols - size) // stride + 1
        pixels = (max(rows, 0) * max(cols, 0) * features, "network.obs_shape")
        dense("dense", pixels, (network["dense"], "network.dense"))
        top = (network["dense"], "network.dense")
    dense("actor_out", top, (network["action_dim"], "network.action_dim"))
    dense("critic_out", top, (1, "network"))
    if not network["discrete"]:
        shapes["log_std"] = ((network["action_dim"], "network.action_dim"),)
    return shapes


def _check_arrays(meta_path: Path, network: dict[str, Any], params: dict, mean, var) -> None:
    """params.npz and obs_norm.npz must be the arrays member.json's network describes (an
    edited size would otherwise fail inside the policy, or read the wrong arrays)."""
    want = _array_shapes(network)
    missing, extra = sorted(set(want) - set(params)), sorted(set(params) - set(want))
    if missing or extra:
        odd = {name.split("/")[0] for name in missing + extra}
        tower = r"(actor|critic)_\d+" if network["kind"] == "ActorCritic" else r"convs_\d+"
        field = "network.hidden" if network["kind"] == "ActorCritic" else "network.convs"
        if odd == {"log_std"}:
            field = "network.discrete"
        elif not all(re.fullmatch(tower, layer) for layer in odd):
            field = "network.kind"
        named = (("missing from it", missing), ("not in the network", extra))
        parts = [f"{how}: {', '.join(names)}" for how, names in named if names]
        raise _edited(meta_path, f"field {field!r} does not match params.npz ({'; '.join(parts)})")
    for name, axes in want.items():
        shape, sizes = tuple(params[name].shape), tuple(size for size, _ in axes)
        if shape != sizes:
            bad = [f for (size, f), got in zip(axes, shape) if size != got] or ["network"]
            value = (
                "" if bad[0] == "network" else f" ({_show(_field({'network': network}, bad[0]))})"
            )
            raise _edited(
                meta_path,
                f"field {bad[0]!r}{value} does not match params.npz: its {name} has shape "
                f"{shape}, the field makes it {sizes}",
            )
    for name, array in (("mean", mean), ("var", var)):
        if tuple(array.shape) != tuple(network["obs_shape"]):
            raise _edited(
                meta_path,
                f"field 'network.obs_shape' ({_show(network['obs_shape'])}) does not match "
                f"obs_norm.npz: its {name} has shape {tuple(array.shape)}",
            )


def _check_finite(path: Path, params: dict, mean: Any, var: Any) -> None:
    """Training never saves a NaN (it stops first), so one here is damage: a NaN logit would
    score as a real policy (argmax takes action 0), and drag the ensemble's average with it."""
    arrays = {**{f"params.npz {k}": v for k, v in params.items()}, "obs_norm.npz mean": mean}
    bad = [name for name, a in arrays.items() if not bool(jnp.isfinite(a).all())]
    if not bool((jnp.isfinite(var) & (var >= 0)).all()):
        bad.append("obs_norm.npz var")
    if bad:
        raise NotAnExport(
            f"{path}: the member's arrays hold NaN or infinite values, or a negative variance "
            f"({', '.join(bad)}): damaged; export the member again."
        )


def read_member(directory: str | os.PathLike, device: jax.Device | None = None) -> ExportedMember:
    """Reads one member directory; its arrays go to ``device`` (default: the first device).

    Raises :class:`NotAnExport` (a ``ValueError``) when ``directory`` is not an exported member,
    or one whose ``member.json`` disagrees with the format, with itself or with its arrays (a
    hand edit): one line naming the file and the field.
    """
    path = Path(directory)
    meta_path = path / "member.json"
    if not meta_path.is_file():
        if (path / "params.npz").exists() or (path / "obs_norm.npz").exists():
            raise NotAnExport(_partial(path))
        raise NotAnExport(f"{path} is not an exported member (no member.json).")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise _edited(meta_path, f"not valid JSON ({e})") from None
    _check_fields(meta_path, meta)
    _check_agreement(meta_path, meta)
    device = device or jax.devices()[0]
    try:
        with np.load(path / "params.npz") as f:
            params = {k: jax.device_put(f[k], device) for k in f.files}
        with np.load(path / "obs_norm.npz") as f:
            mean, var = jax.device_put(f["mean"], device), jax.device_put(f["var"], device)
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
        # (a truncated or empty .npz: NumPy raises zipfile's error or EOFError)
        raise NotAnExport(f"{path}: cannot read the member's arrays ({e}).") from None
    _check_arrays(meta_path, meta["network"], params, mean, var)
    _check_finite(path, params, mean, var)
    _check_obs_norm(meta_path, meta)  # after the arrays: an edited 'discrete' is named there
    _check_start(meta_path, meta)  # (so too here)
    return ExportedMember(meta=meta, params=params, obs_mean=mean, obs_var=var, path=path)


def load_member(
    directory: str | os.PathLike, device: jax.Device | None = None
) -> Callable[[ArrayLike], jax.Array]:
    """The deterministic policy ``act(obs) -> action`` of an exported member (jittable).

    ``obs``: raw observations ``[..., *obs_shape]`` (normalisation is inside). Discrete:
    ``argmax`` of the logits plus the action space's ``start`` (int32), the action the env's
    ``step`` takes; continuous: the Gaussian's mean clipped into the box.
    """
    return read_member(directory, device).act


def _export_of(export: Path, run: Path) -> bool:
    """Whether ``export`` holds members of the run in ``run``, not of a run that an
    ``--overwrite`` replaced (an unreadable ``run.json`` counts as the same run)."""
    try:
        config = json.loads((run / "run.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return _other_run_member(export, config) is None


def member_dirs(directory: str | os.PathLike) -> list[Path]:
    """The member directories of an export: ``directory`` itself if it is one, else its
    ``member_<i>`` subdirectories in member order. Raises :class:`NotAnExport` if none, or if
    one has no ``member.json`` (an interrupted export: leaving it out would quietly make the
    ensemble smaller)."""
    path = Path(directory)
    if not path.is_dir():
        raise NotAnExport(f"{path} is not a directory.")
    if (path / "member.json").is_file():
        return [path]
    if (path / "params.npz").exists() or (path / "obs_norm.npz").exists():
        raise NotAnExport(_partial(path))  # a member directory itself, cut short
    index = lambda p: int(p.name.split("_", 1)[1]) if p.name.split("_", 1)[1].isdigit() else -1
    found = sorted(
        (p for p in path.glob("member_*") if p.is_dir()), key=lambda p: (index(p), p.name)
    )
    partial = [p for p in found if not (p / "member.json").is_file()]
    if partial:
        raise NotAnExport(_partial(partial[0], len(partial) - 1))
    if not found:
        raise NotAnExport(_no_members(path))
    return found


def _no_members(path: Path) -> str:
    """Why a directory without member directories is not an export, and what to do."""
    if (path / "run.json").is_file():  # a training run's --out
        export = path / "export"
        q = lambda p: shlex.quote(str(p))  # commands to paste into a shell
        command = f"python -m rollout.ppo.export {q(path)}"
        how = f"export it ({command}), then "
        if export.is_dir() and _export_of(export, path):
            how = ""
        elif export.is_dir():
            how = f"its export holds another run's members: export again ({command}), then "
        return f"{path} is a training run, not an export: {how}evaluate {q(export)}."
    return (
        f"{path} holds no exported members (member_<i>/member.json); write them with "
        "python -m rollout.ppo.export RUN_DIR or rollout.ppo.export.export_members."
    )


# ---------------------------------------------------------------------- from a run directory


def export_run(
    run_dir: str | os.PathLike,
    directory: str | os.PathLike | None = None,
    members: Sequence[int] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> list[Path]:
    """Exports members of the newest restorable checkpoint of a training run.

    ``run_dir`` is the ``--out`` of ``python -m rollout.ppo`` (``run.json`` and checkpoints);
    the members go to ``directory`` (default ``run_dir/export``). The run is only read: a
    checkpoint that fails to restore is skipped with a warning, never renamed or removed.
    Raises :class:`NotAnExport` (a ``ValueError``) if ``run_dir`` is not a run with a checkpoint.
    """
    from rollout.ppo import Learner
    from rollout.ppo import _checkpoint as ckpt
    from rollout.ppo._config import PPOConfig

    run = Path(run_dir)
    try:
        found = ckpt.inspect(run)
    except ckpt.RunDirError as e:  # its wording names training's --out; export has none
        said = str(e).replace("--out ", "", 1)
        raise NotAnExport(said.replace("move it away or use --overwrite", "restore it")) from None
    if found.record is None:
        what = "has no run.json" if run.is_dir() else "does not exist"
        raise NotAnExport(f"{run} {what}: give the --out directory of a training run.")
    if not ckpt.checkpoints(run):
        raise NotAnExport(
            f"{run} has no checkpoint yet: training writes one every --checkpoint-every calls "
            "and when it ends, but not at an error (a divergence included): train it longer, "
            "or again after the error."
        )
    if not found.record.get("env_from_config", True):
        raise NotAnExport(
            f"{run} trained on an env given to Learner(config, env=...), which its run.json "
            "cannot make again; export it in Python with that env: export_members(Learner("
            "config, env=...), state, directory), state from train(config, run, resume=True, "
            "learner=...)."
        )
    try:
        config = PPOConfig.from_dict(found.record["config"])
    except (TypeError, ValueError) as e:
        raise NotAnExport(f"{run / ckpt.RUN_FILE} holds no usable config ({e}).") from None
    learner = Learner(config, devices=devices)
    try:
        _chosen(members, config.members, directory or run / "export")  # before the restore
        state = _restore_newest(run, found.record, ckpt.restore_targets(learner))
        to = directory or run / "export"
        return _export_learners(learner, state, to, members, found.record.get("run_id"))
    finally:
        learner.close()


def _restore_newest(run: Path, record: dict[str, Any], like: Any, attempts: int = 5) -> Any:
    """The newest whole checkpoint of a run that may still be training: a run keeps only its
    newest checkpoints, so one listed here may be removed while it is read; then the listing
    is read again (the warnings of a failed try are shown only if nothing changed)."""
    from rollout.ppo import _checkpoint as ckpt

    for _ in range(attempts):
        listed, notes = ckpt.checkpoints(run), []
        try:
            state, _ = ckpt.restore_latest(
                run, record, like, notes.append, set_aside=False, keys_as_saved=True
            )
            for line in notes:  # a damaged newer checkpoint; not one the run pruned meanwhile
                if any(f"checkpoint {p} " in line for p in ckpt.checkpoints(run)):
                    print(line, file=sys.stderr)
            return state
        except ckpt.NoRestorableCheckpoint as e:
            if ckpt.checkpoints(run) != listed:
                continue  # the run wrote a newer one meanwhile: try that
            for line in notes:
                print(line, file=sys.stderr)
            raise NotAnExport(f"no checkpoint in {run} can be restored ({e.what}).") from None
    raise NotAnExport(
        f"{run} is still writing checkpoints faster than they can be read; export it when it "
        "has stopped, or with a larger --checkpoint-every."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rollout.ppo.export RUN_DIR [--to DIR] [--members 0,2]``; 2 on bad input."""
    from rollout.ppo._parser import OneLineParser

    p = OneLineParser(
        prog="python -m rollout.ppo.export",
        description="Export trained members of a run (its newest checkpoint) for inference.",
    )
    p.add_argument("run_dir", help="the --out directory of python -m rollout.ppo")
    p.add_argument("--to", default=None, help="export directory (default RUN_DIR/export)")
    p.add_argument("--members", default=None, help="comma-separated member indices (default all)")
    args = p.parse_args(argv)
    try:
        chosen = None if args.members is None else [int(i) for i in args.members.split(",")]
    except ValueError:
        print(f"error: --members {args.members!r}: give indices like 0,2", file=sys.stderr)
        return 2
    try:
        paths = export_run(args.run_dir, args.to, chosen, devices=_devices_for_run(args.run_dir))
    except (ValueError, IndexError) as e:  # NotAnExport, a member out of range
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    except OSError as e:  # --to under a file, or somewhere not writable
        where = e.filename or args.to
        print(f"error: cannot write the export to {where}: {e.strerror}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _devices_for_run(run_dir: str) -> list[jax.Device] | None:
    """On a CPU-only host, as many simulated devices as training would use (set before JAX)."""
    from rollout.ppo import _checkpoint as ckpt
    from rollout.ppo._cli import configure_devices, cpu_devices_for

    try:
        record = ckpt.inspect(run_dir).record
    except ckpt.RunDirError:
        return None  # export_run says why
    members = (record or {}).get("config", {}).get("members")
    if not isinstance(members, int) or members < 1:
        return None  # export_run says why
    cores = available_cores()
    wanted = cpu_devices_for(members, cores)
    configure_devices(max(wanted, cores))
    return jax.devices()[:wanted] if jax.default_backend() == "cpu" else None


if __name__ == "__main__":
    from ensemble._exit import exit_process
    from rollout.ppo._checkpoint import quiet_failed_checkpoint_io

    # A damaged newest checkpoint (export falls back to the one before) or one a run still
    # training removes while it is read: one warning line, not hundreds of tracebacks.
    quiet_failed_checkpoint_io()
    exit_process(main())
