"""Checkpoints of the whole train state: params, optimizer, env states, normaliser stats, keys.

A checkpoint is a directory ``ckpt_<update>/`` with ``state.npz`` (every leaf of the train state,
in tree order) and ``meta.json`` (the config, the update counter and each leaf's path, shape and
dtype). Writing gathers the state to the host once (saving is one of the few places where a member
may leave its device); restoring puts every leaf straight back onto its shard with
``jax.device_put(..., learner.state_shardings())``. Because the state holds the raw RNG keys and
the update counter, a restored run continues exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rollout.ppo._config import PPOConfig

_PREFIX = "ckpt_"


def save(directory: str | os.PathLike, state: Any, config: PPOConfig, keep: int = 2) -> Path:
    """Writes ``state`` to ``directory/ckpt_<update>/`` atomically; keeps the ``keep`` newest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    update = int(jax.device_get(state.update))
    leaves = jax.tree_util.tree_leaves_with_path(state)
    # Collective: with several processes every one calls save(); members on other processes'
    # devices come over once (process_allgather), and only process 0 writes.
    from ensemble.distributed import gather_metrics_to_host

    host = gather_metrics_to_host([x for _, x in leaves])
    arrays = {f"leaf_{i:04d}": np.asarray(a) for i, a in enumerate(host)}
    final = directory / f"{_PREFIX}{update:08d}"
    if jax.process_index() != 0:
        _wait_for_writer(update)
        return final
    meta = {
        "update": update,
        "config": config.to_dict(),
        "leaves": [
            {"path": jax.tree_util.keystr(p), "shape": list(a.shape), "dtype": str(a.dtype)}
            for (p, _), a in zip(leaves, arrays.values())
        ],
    }
    # Write into a temporary sibling, then rename: a crash never leaves a half checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=".tmp_ckpt_", dir=directory))
    np.savez(tmp / "state.npz", **arrays)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in directory.glob(".tmp_ckpt_*"):  # left by a run killed while saving
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    _wait_for_writer(update)
    return final


def _wait_for_writer(update: int) -> None:
    """No process reads (resume) or moves on before process 0 has written the checkpoint."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"rollout.ppo checkpoint {update}")


def checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.glob(f"{_PREFIX}*") if (p / "meta.json").exists()]
    return sorted(found, key=lambda p: p.name)


def latest(directory: str | os.PathLike) -> Path | None:
    found = checkpoints(directory)
    return found[-1] if found else None


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / "meta.json").read_text())


def restore(path: str | os.PathLike, shapes: Any, shardings: Any) -> Any:
    """Loads a checkpoint into the structure of ``shapes``, each leaf onto its sharding."""
    path = Path(path)
    meta = read_meta(path)
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    shard_leaves = jax.tree_util.tree_leaves(shardings)
    with np.load(path / "state.npz") as data:
        arrays = [data[f"leaf_{i:04d}"] for i in range(len(data.files))]
    if len(arrays) != len(leaves):
        raise ValueError(
            f"checkpoint {path} has {len(arrays)} arrays but this learner's state has "
            f"{len(leaves)} leaves; it was written by a different configuration or version."
        )
    for i, (a, want) in enumerate(zip(arrays, leaves)):
        if tuple(a.shape) != tuple(want.shape) or a.dtype != want.dtype:
            where = meta["leaves"][i]["path"] if i < len(meta.get("leaves", [])) else f"#{i}"
            raise ValueError(
                f"checkpoint leaf {where} is {a.dtype}{list(a.shape)}, the learner expects "
                f"{want.dtype}{list(want.shape)}."
            )
    placed = [jax.device_put(a, s) for a, s in zip(arrays, shard_leaves)]
    return jax.tree_util.tree_unflatten(treedef, placed)
