"""Exported members: one self-contained directory per PPO agent, loadable without the trainer.

:func:`export_members` writes, for each member ``i``, ``<directory>/member_<i>/`` with

- ``member.json``: ``{"format": "rollout.ppo.member", "version": 2, "member": i, "env": ...,
  "gymnasium_id": ..., "env_steps": ..., "network": {...}, "obs_norm": {...}, "action": {...},
  "hparams": {...}, "config": {...}}``. ``gymnasium_id`` is what ``gymnasium.make`` takes for
  the env (``null`` where gymnasium has no such env). ``network`` holds ``kind``,
  ``obs_shape``, ``action_dim``, ``discrete`` and ``activation``, and per kind:

  - ``"ActorCritic"`` (vector observations): ``hidden`` (layer widths); ``activation`` "tanh".
  - ``"ImageActorCritic"`` (image observations): ``convs`` (``[features, kernel size,
    stride]`` per VALID conv), ``dense`` (width), ``channels_first`` and ``obs_scale``;
    ``activation`` "relu".

  ``obs_norm`` holds ``enabled``, ``clip`` and ``epsilon``; ``action`` holds the continuous
  action box ``low`` / ``high``: one number per action dimension, ``null`` for an infinite
  bound (no clipping on that side of that dimension); the whole entry is ``null`` for a
  discrete action or a side unbounded in every dimension.
- ``params.npz``: the network's arrays, named ``<layer>/<kernel|bias>``, plus ``log_std`` for
  continuous actions. ``ActorCritic``: ``actor_0``, ``actor_1``, ..., ``actor_out``,
  ``critic_0``, ..., ``critic_out``. ``ImageActorCritic``: ``convs_0``, ``convs_1``, ...
  (kernels ``[k, k, in, out]``), ``dense``, ``actor_out``, ``critic_out``. A Dense layer is
  ``x @ kernel + bias``.
- ``obs_norm.npz``: ``mean``, ``var`` (observation shape) and ``count`` of the running
  observation statistics.

The policy is: ``z = clip((obs - mean) / sqrt(var + epsilon), -clip, clip)`` when
``obs_norm.enabled`` (else ``z = obs``); then

- ``ActorCritic``: ``h = activation(h @ kernel + bias)`` through the actor layers, ``head = h @
  actor_out.kernel + actor_out.bias``;
- ``ImageActorCritic``: ``h = z * obs_scale``, transposed ``[C, H, W] -> [H, W, C]`` when
  ``channels_first``; ``h = relu(conv(h) + bias)`` per conv (VALID padding, the given stride,
  cross-correlation as in every deep-learning library); flattened in ``(H, W, C)`` order;
  ``h = relu(h @ dense.kernel + dense.bias)``; ``head = h @ actor_out.kernel + actor_out.bias``.

The deterministic action is ``argmax(head)`` (discrete) or ``clip(head, low, high)``
(continuous: the mean of the Gaussian). Version 1 (vector observations only) is the same
``ActorCritic`` format and is still read.

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
import shlex
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rollout._devices import available_cores

FORMAT = "rollout.ppo.member"
VERSION = 2
#: Format versions this module reads.
READABLE_VERSIONS = (1, 2)
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
    return _export(learner.config, learner.spec, learner.normalize_obs, state, directory, members)


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
    return _export(config, spec, envlib.normalize_obs(config, spec), state, directory, members)


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


def _other_run_member(export: Path, config: dict[str, Any]) -> Path | None:
    """The first member directory in ``export`` exported from a run of another config (None if
    all are this run's); members whose ``member.json`` cannot be read are not counted."""
    for meta_file in sorted(export.glob("member_*/member.json")):
        try:
            other = json.loads(meta_file.read_text()).get("config")
        except (OSError, ValueError, AttributeError):
            continue  # not readable as an export: nothing of a run to protect
        if other != config:
            return meta_file.parent
    return None


def _check_same_run(root: Path, config: Any) -> None:
    """Refuses to write into an export of another run: its members would be replaced, and the
    rest then mixed with this run's into one "ensemble"."""
    other = _other_run_member(root, config.to_dict())
    if other is not None:
        raise ValueError(
            f"{root} holds members of another run ({other.name}); export to an empty directory "
            "(another --to), or remove that export first."
        )


def _export(config, spec, normalize_obs, state, directory, members) -> list[Path]:
    n = config.members
    chosen = _chosen(members, n, directory)
    root = Path(directory)
    _check_same_run(root, config)
    root.mkdir(parents=True, exist_ok=True)
    env_steps = int(jax.device_get(state.update)) * config.batch_size
    network = network_meta(config, spec)
    paths = []
    for i in chosen:
        if not _held_here(state.members.params, i, n):
            continue  # another process holds this member and writes it
        params, stats, hparams = member_arrays(state, i)
        path = root / f"member_{i}"
        path.mkdir(exist_ok=True)
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
        (path / "member.json").write_text(json.dumps(meta, indent=2) + "\n")
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


def _metadata(config, spec, network, normalize_obs, i, env_steps, hparams) -> dict[str, Any]:
    def box(a: Any) -> list[float | None] | None:  # JSON has no infinity: null
        if a is None:
            return None
        return [float(v) if np.isfinite(v) else None for v in np.asarray(a, np.float32).ravel()]

    return {
        "format": FORMAT,
        "version": VERSION,
        "member": i,
        "env": config.env,
        "gymnasium_id": gymnasium_id(config.env),
        "env_steps": env_steps,
        "network": network,
        "obs_norm": {"enabled": bool(normalize_obs), "clip": OBS_CLIP, "epsilon": OBS_EPSILON},
        "action": {
            "low": None if spec.discrete else box(spec.action_low),
            "high": None if spec.discrete else box(spec.action_high),
        },
        "hparams": {k: float(v) for k, v in hparams.items()},
        "config": config.to_dict(),
    }


# ---------------------------------------------------------------------- reading


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

    @property
    def discrete(self) -> bool:
        return bool(self.meta["network"]["discrete"])

    def normalize(self, obs: jax.Array) -> jax.Array:
        norm = self.meta["obs_norm"]
        obs = jnp.asarray(obs, jnp.float32)
        if not norm["enabled"]:
            return obs
        z = (obs - self.obs_mean) / jnp.sqrt(self.obs_var + norm["epsilon"])
        return jnp.clip(z, -norm["clip"], norm["clip"])

    def head(self, obs: jax.Array) -> jax.Array:
        """The policy head for raw observations ``[..., *obs_shape]``: logits, or the mean."""
        network = self.meta["network"]
        act_fn = _ACTIVATIONS[network["activation"]]
        dense = lambda h, name: h @ self.params[f"{name}/kernel"] + self.params[f"{name}/bias"]
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
            h = act_fn(h + self.params[f"convs_{k}/bias"])
        return h.reshape(*lead, -1)

    def probs(self, obs: jax.Array) -> jax.Array:
        """Discrete only: the action probabilities ``softmax(logits)``."""
        return jax.nn.softmax(self.head(obs), axis=-1)

    def clip_action(self, action: jax.Array) -> jax.Array:
        """A continuous action clipped into the env's box (as the learner's env step does)."""
        low, high = (_bound(self.meta["action"][k], s) for k, s in (("low", -1), ("high", 1)))
        return jnp.clip(action, low, high)  # None: unbounded on that side

    def act(self, obs: jax.Array) -> jax.Array:
        """Deterministic actions for raw observations: argmax (int32) or the clipped mean."""
        head = self.head(obs)
        if self.discrete:
            return jnp.argmax(head, axis=-1).astype(jnp.int32)
        return self.clip_action(head)


def read_member(directory: str | os.PathLike, device: jax.Device | None = None) -> ExportedMember:
    """Reads one member directory; its arrays go to ``device`` (default: the first device).

    Raises :class:`NotAnExport` (a ``ValueError``) when ``directory`` is not an exported member.
    """
    path = Path(directory)
    meta_path = path / "member.json"
    if not meta_path.is_file():
        raise NotAnExport(f"{path} is not an exported member (no member.json).")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise NotAnExport(f"{meta_path} is not valid JSON ({e}).") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise NotAnExport(f"{meta_path} is not a {FORMAT} file.")
    if meta.get("version") not in READABLE_VERSIONS:
        raise NotAnExport(
            f"{meta_path} has format version {meta.get('version')}; this version of the "
            f"library reads {', '.join(map(str, READABLE_VERSIONS))}."
        )
    network = meta.get("network") or {}
    if network.get("kind", "ActorCritic") not in ("ActorCritic", "ImageActorCritic"):
        raise NotAnExport(f"{meta_path}: unknown network kind {network.get('kind')!r}.")
    if network.get("activation") not in _ACTIVATIONS:
        raise NotAnExport(f"{meta_path}: unknown activation {network.get('activation')}.")
    device = device or jax.devices()[0]
    try:
        with np.load(path / "params.npz") as f:
            params = {k: jax.device_put(f[k], device) for k in f.files}
        with np.load(path / "obs_norm.npz") as f:
            mean, var = jax.device_put(f["mean"], device), jax.device_put(f["var"], device)
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
        # (a truncated or empty .npz: NumPy raises zipfile's error or EOFError)
        raise NotAnExport(f"{path}: cannot read the member's arrays ({e}).") from None
    return ExportedMember(meta=meta, params=params, obs_mean=mean, obs_var=var)


def load_member(
    directory: str | os.PathLike, device: jax.Device | None = None
) -> Callable[[jax.Array], jax.Array]:
    """The deterministic policy ``act(obs) -> action`` of an exported member (jittable).

    ``obs``: raw observations ``[..., *obs_shape]`` (normalisation is inside). Discrete:
    ``argmax`` of the logits (int32); continuous: the Gaussian's mean clipped into the box.
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
    ``member_<i>`` subdirectories in member order. Raises :class:`NotAnExport` if none."""
    path = Path(directory)
    if not path.is_dir():
        raise NotAnExport(f"{path} is not a directory.")
    if (path / "member.json").is_file():
        return [path]
    found = [p for p in path.glob("member_*") if (p / "member.json").is_file()]
    if not found:
        if (path / "run.json").is_file():  # a training run's --out
            export = path / "export"
            q = lambda p: shlex.quote(str(p))  # commands to paste into a shell
            command = f"python -m rollout.ppo.export {q(path)}"
            how = f"export it ({command}), then "
            if export.is_dir() and _export_of(export, path):
                how = ""
            elif export.is_dir():
                how = f"its export holds another run's members: export again ({command}), then "
            raise NotAnExport(
                f"{path} is a training run, not an export: {how}evaluate {q(export)}."
            )
        raise NotAnExport(
            f"{path} holds no exported members (member_<i>/member.json); write them with "
            "python -m rollout.ppo.export RUN_DIR or rollout.ppo.export.export_members."
        )
    index = lambda p: int(p.name.split("_", 1)[1]) if p.name.split("_", 1)[1].isdigit() else -1
    return sorted(found, key=lambda p: (index(p), p.name))


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
        raise NotAnExport(str(e).replace("--out ", "", 1)) from None
    if found.record is None:
        what = "has no run.json" if run.is_dir() else "does not exist"
        raise NotAnExport(f"{run} {what}: give the --out directory of a training run.")
    if not ckpt.checkpoints(run):
        raise NotAnExport(f"{run} has no checkpoint yet: train longer (--checkpoint-every).")
    try:
        config = PPOConfig.from_dict(found.record["config"])
    except (TypeError, ValueError) as e:
        raise NotAnExport(f"{run / ckpt.RUN_FILE} holds no usable config ({e}).") from None
    learner = Learner(config, devices=devices)
    try:
        _chosen(members, config.members, directory or run / "export")  # before the restore
        state = _restore_newest(run, found.record["run_id"], ckpt.restore_targets(learner))
        return export_members(learner, state, directory or run / "export", members)
    finally:
        learner.close()


def _restore_newest(run: Path, run_id: str, like: Any, attempts: int = 5) -> Any:
    """The newest whole checkpoint of a run that may still be training: a run keeps only its
    newest checkpoints, so one listed here may be removed while it is read; then the listing
    is read again (the warnings of a failed try are shown only if nothing changed)."""
    from rollout.ppo import _checkpoint as ckpt

    for _ in range(attempts):
        listed, notes = ckpt.checkpoints(run), []
        try:
            state, _ = ckpt.restore_latest(run, run_id, like, notes.append, False)
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

    exit_process(main())
