"""Run directories of ``rollout.ppo``: which run a directory holds, and its checkpoints.

A run directory holds one run:

- ``run.json``: the run's identity (a random ``run_id``, the config, when it started);
- ``metrics.jsonl``: one JSON row per PPO update; ``learning_curve.png``;
- ``ckpt_<update>/``: orbax checkpoints (``ensemble.distributed.save_checkpoint``) of the whole
  train state. Every process writes the shards of its own members (nothing member-shaped is
  gathered onto one host); orbax writes into a temporary sibling and renames it when complete,
  so a ``ckpt_*`` directory is always whole. Its metadata records the run id, the update, how
  many metric rows belong to it and a per-member checksum of every leaf, so a resumed run cuts
  ``metrics.jsonl`` back to exactly the checkpoint and a damaged checkpoint is never used.

Nothing here overwrites what a run wrote unless asked: a fresh run refuses a directory that
holds another run (``--resume`` continues it, ``--overwrite`` moves it away first).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import re
import shutil
import sys
import threading
import traceback
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "learning_curve.png"
#: Written next to a run from its files (PBT's lineage plot, the default export): its own, so a
#: fresh run refuses them and ``--overwrite`` removes them with the run.
DERIVED = ("pbt_lineage.png", "export")
LOCK_FILE = ".lock"  # held (flock) by the process that writes the run
#: Version of the run directory layout (1 was the npz checkpoint format, not readable).
FORMAT = 2
_CKPT = re.compile(r"^ckpt_(\d{8})$")
_SET_ASIDE = re.compile(r"^ckpt_\d{8}\.unreadable$")
#: An old run's logger files that an ``--overwrite`` start moved aside: still the old run's
#: until that start removes the run (with them), put back if it is cut short before.
_LOGS_ASIDE = re.compile(r"^\.(tensorboard|wandb|wandb_run_id)\.overwritten$")
#: Left by a run cut short (killed, a full disk) while saving, deleting or writing a file.
_LEFTOVER = re.compile(
    r"^(ckpt_\d{8}\.orbax-checkpoint-tmp.*|\.trash-[0-9a-f]{32}|"
    r"\.(run\.json\.|metrics\.jsonl\.|probe-)[0-9a-f]{32})$"
)
#: Config fields a resumed run may change (only upwards: a longer run).
EXTENDABLE = ("total_steps",)


class RunDirError(ValueError):
    """A run directory that cannot be used as asked; the message says what to do instead.

    Example:
      >>> import os, tempfile
      >>> from rollout.ppo import PPOConfig, train
      >>> out = tempfile.mkdtemp()  # empty: no run to resume
      >>> try:
      ...     train(PPOConfig.for_env("cartpole", members=8), out=out, resume=True)
      ... except RunDirError as e:  # raised before anything is built or written
      ...     print(str(e).split(" in ")[0], os.listdir(out))
      nothing to resume []
      >>> os.rmdir(out)
    """


class NoRestorableCheckpoint(RunDirError):
    """No checkpoint of the run restores whole; ``tried``: the names of those that failed."""

    def __init__(self, out: Path, tried: list[str]):
        self.out, self.tried = out, tried
        super().__init__(
            f"--resume: no checkpoint in {out} can be restored ({self.what}); start over in "
            "another --out (they stay as they are), or with --overwrite (which deletes them)."
        )

    @property
    def what(self) -> str:
        return f"tried {', '.join(self.tried) or 'none'}; reasons above"


@dataclasses.dataclass(frozen=True)
class RunDir:
    """What a directory holds, read without writing anything."""

    path: Path
    record: dict[str, Any] | None  # run.json, or None
    files: tuple[Path, ...]  # entries a run writes (run.json, metrics, plot, checkpoints)
    legacy: bool  # checkpoints of the old npz format

    @property
    def empty(self) -> bool:
        return not self.files


# ---------------------------------------------------------------------- run directory


def quiet_failed_checkpoint_io() -> None:
    """For a command line (it runs no coroutine of the user's): when a checkpoint read or
    write fails (a damaged checkpoint, a full disk), the one line that says so, not the
    tracebacks of TensorStore operations still in flight (up to hundreds): those that complete
    into orbax's closed event loop, the failed reads whose task or future nobody awaits, which
    asyncio logs when it collects them, and the coroutines that were never awaited."""
    sys.unraisablehook = without_closed_loop_noise(sys.unraisablehook)
    threading.excepthook = without_closed_loop_noise(threading.excepthook)
    logging.getLogger("asyncio").addFilter(_unawaited_orbax_failures)
    warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)


_UNAWAITED = ("Task exception was never retrieved", "Future exception was never retrieved")


def _unawaited_orbax_failures(record: Any) -> bool:
    """A ``logging`` filter: False for asyncio's "... exception was never retrieved" about an
    exception of orbax's or TensorStore's, True (kept) for everything else."""
    if not record.getMessage().startswith(_UNAWAITED):
        return True
    exc = record.exc_info[1] if record.exc_info else None
    if exc is None:
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    theirs = (f"{os.sep}orbax{os.sep}", f"{os.sep}tensorstore{os.sep}")
    in_their_code = any(part in frame.filename for frame in frames for part in theirs)
    return not (in_their_code or "tensorstore_spec" in str(exc))


# What orbax's work still in flight raises once the failed operation's loop or the
# interpreter has closed: never the error to report (the CLI's one line says that).
_CLOSED = ("Event loop is closed", "cannot schedule new futures after interpreter shutdown")


def without_closed_loop_noise(hook: Any) -> Any:
    """``hook`` (for ``sys.unraisablehook`` or ``threading.excepthook``) that skips the errors
    of work that outlived its loop or the interpreter. When a checkpoint write or read fails
    (a full disk, a damaged checkpoint), TensorStore's operations still in flight complete
    into orbax's closed event loop, and its threads schedule work at exit, each printing a
    traceback (up to hundreds) around the one line that says what failed."""

    def skip(info: Any) -> None:
        closed = isinstance(info.exc_value, RuntimeError) and str(info.exc_value) in _CLOSED
        if not closed:
            hook(info)

    return skip


def inspect(out: str | os.PathLike) -> RunDir:
    """Reads what ``out`` holds; raises :class:`RunDirError` if it is not a usable directory."""
    out = Path(out)
    if out.is_symlink() and not out.exists():
        raise RunDirError(
            f"--out {out} is a link to {os.readlink(out)}, which does not exist; create that "
            "directory or give another path."
        )
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory; give a directory path.")
    if not out.exists():
        return RunDir(out, None, (), False)
    try:
        names = sorted(os.listdir(out))
    except OSError as e:
        raise RunDirError(f"--out {out} cannot be read ({e.strerror}); give another path.") from e
    files = tuple(
        out / n
        for n in names
        if n in (RUN_FILE, METRICS_FILE, CURVE_FILE, *DERIVED)
        or _CKPT.match(n)
        or _SET_ASIDE.match(n)
        or _LOGS_ASIDE.match(n)
    )
    legacy = any(_is_legacy(p) for p in files if _CKPT.match(p.name))
    record = None
    if (out / RUN_FILE).exists():
        try:
            record = json.loads((out / RUN_FILE).read_text())
            _check_record(record)
        except (OSError, ValueError) as e:
            raise RunDirError(
                f"{out / RUN_FILE} is unreadable ({e}); move it away or use --overwrite."
            ) from e
    return RunDir(out, record, files, legacy)


def _check_record(record: Any) -> None:
    """The fields of ``run.json`` that are read before its config is: a hand-edited one of
    another type ("devices": "two", "config": "x") was an AttributeError or ValueError of
    Python's, and "devices": 1.5 resumed on 1 device."""
    if not isinstance(record, dict) or "run_id" not in record or "config" not in record:
        raise ValueError("no run_id / config")
    if not isinstance(record["run_id"], str) or not record["run_id"]:
        raise ValueError(f"run_id {record['run_id']!r} is not the run's id, a string")
    if not isinstance(record["config"], dict):
        raise ValueError(f"config {record['config']!r} is not a JSON object of settings")
    devices, platform = record.get("devices"), record.get("platform")
    if devices is not None and (type(devices) is not int or devices < 1):
        raise ValueError(f"devices {devices!r} is not a device count")
    if platform is not None and not isinstance(platform, str):
        raise ValueError(f"platform {platform!r} is not a platform name")


def _is_legacy(ckpt: Path) -> bool:
    try:
        return (ckpt / "state.npz").exists()
    except OSError:  # an unreadable checkpoint: restoring it says so (and uses an older one)
        return False


def check_writable(out: str | os.PathLike) -> None:
    """Creates ``out`` if needed and checks a file can be written there (a probe, removed)."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RunDirError(
            f"--out {out} is not a writable directory ({e.strerror or e}); give another path."
        ) from e


def check_unlocked(out: str | os.PathLike) -> None:
    """Refuses, before anything starts, an ``out`` that another running process has locked
    (``lock`` itself refuses too: this only says so before the run prints or builds anything)."""
    path = Path(out) / LOCK_FILE
    if path.is_file():
        lock(Path(out)).close()  # taken and released at once


def lock(out: Path) -> Any:
    """An exclusive lock on ``out`` while a run writes there; refuses if another process has it.

    Returns the open lock file: the lock lasts until it is closed or the process ends (even by
    SIGKILL), so a dead run never leaves a stale lock. A no-op where ``fcntl`` is missing.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = (out / LOCK_FILE).open("a")
    except OSError as e:  # read-only, or not ours: before anything else says less
        if (out / LOCK_FILE).is_file() and os.access(out, os.W_OK):
            raise RunDirError(
                f"--out {out}: its lock file {LOCK_FILE} cannot be opened ({e.strerror or e}); "
                "give it back write permission (or remove it: no run holds a lock it cannot "
                "open), or choose another --out."
            ) from None
        raise RunDirError(
            f"--out {out} is not a writable directory ({e.strerror or e}); give another path."
        ) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise RunDirError(
            f"--out {out} is in use by another running process; wait for it to end (or stop "
            "it), or choose another --out."
        ) from None
    return f


def new_record(config: dict[str, Any]) -> dict[str, Any]:
    """The ``run.json`` of a fresh run of ``config`` (a ``PPOConfig.to_dict()``)."""
    return {
        "format": FORMAT,
        "run_id": uuid.uuid4().hex,
        "seed": config.get("seed"),
        "config": config,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def check_fresh(run: RunDir, overwrite: bool) -> None:
    """A fresh run may start in ``run.path`` (empty of run files, or ``overwrite``)."""
    if run.empty or overwrite:
        return
    what = _describe(run)
    # Only a run with a run.json and a checkpoint can continue; anything else only be replaced.
    can_resume = run.record is not None and bool(checkpoints(run.path))
    resume = "continue it with --resume, " if can_resume else ""
    raise RunDirError(
        f"--out {run.path} already holds {what}; {resume}start over with "
        "--overwrite (removes that run's files), or choose another --out."
    )


def check_resume(run: RunDir, config: dict[str, Any]) -> dict[str, Any]:
    """The ``run.json`` a resumed run of ``config`` continues; refuses what cannot resume.

    ``config`` may differ from the saved one only in :data:`EXTENDABLE` fields, and only upwards.
    """
    if run.record is None:
        if run.legacy:
            raise RunDirError(
                f"--out {run.path} holds checkpoints of the old npz format, which this version "
                "cannot read; start over with --overwrite or choose another --out."
            )
        if not run.empty:
            raise RunDirError(
                f"--out {run.path} holds run files but no {RUN_FILE}, so it is not a run this "
                "version can continue; start over with --overwrite or choose another --out."
            )
        raise RunDirError(
            f"nothing to resume in --out {run.path} (no {RUN_FILE}); drop --resume to start a "
            "fresh run."
        )
    saved = run.record["config"]
    config = as_saved(saved, config, run.record)
    diffs = config_differences(saved, config)
    if diffs:
        refuse_changed(run.path, diffs)
    if not checkpoints(run.path):
        raise RunDirError(
            f"--resume: {run.path} holds run {run.record['run_id'][:8]} but no checkpoint (it "
            "stopped before its first one, or they were removed); start over with --overwrite."
        )
    return {**run.record, "config": config}


def refuse_changed(path: Any, diffs: str) -> None:
    """Refuses a resume whose flags change the saved run (``diffs``: what they change)."""
    raise RunDirError(
        f"--resume: the run in {path} was started with another config ({diffs}); only "
        "--total-steps may grow. Leave those flags out to use the saved values, or start a new "
        "run in another --out."
    )


def as_saved(saved: dict[str, Any], now: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """``now`` with each setting the run left to the env (``None`` in ``saved``) and that is
    given as what it resolved to (``run.json``'s ``resolved``: ``--no-normalize-obs`` on
    CartPole) put back as ``None``: the same run, not a change."""
    resolved = record.get("resolved") or {}
    same = lambda k, v: saved.get(k) is None and k in resolved and v is resolved[k]
    return {k: None if same(k, v) else v for k, v in now.items()}


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """``'members 4 -> 2, seed 0 -> 1'``: the changes a resume refuses ('' if none)."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if a == b:
            continue
        if key in EXTENDABLE and isinstance(a, int) and isinstance(b, int) and b > a:
            continue
        out.append(f"{key} {a!r} -> {b!r}")
    return ", ".join(out)


def start(out: Path, record: dict[str, Any], *, overwrite: bool) -> None:
    """Process 0: moves an old run away (``overwrite``) and writes ``run.json`` exclusively."""
    out.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(out)
    if overwrite:
        remove_run(out)
    tmp = out / f".{RUN_FILE}.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps(record, indent=1))
    try:
        os.link(tmp, out / RUN_FILE)  # fails if another run's run.json appeared meanwhile
    except FileExistsError:
        raise RunDirError(
            f"--out {out} got another run's {RUN_FILE} while this one started; choose another "
            "--out."
        ) from None
    finally:
        tmp.unlink()


def update_record(out: Path, record: dict[str, Any]) -> None:
    """Process 0: rewrites ``run.json`` atomically (a resume that extends the run)."""
    _atomic_write(out / RUN_FILE, json.dumps(record, indent=1))


def remove_run(out: Path) -> None:
    """Removes the files a run wrote in ``out`` (never anything else); crash-safe.

    Each is first renamed to a hidden name beside it (atomic, and possible whatever the
    entry's own permissions), run.json first, so a crash midway leaves no half run behind that
    could be resumed; then deleted (what cannot be is retried when the run saves).
    """
    names = [RUN_FILE] + [p.name for p in inspect(out).files if p.name != RUN_FILE]
    for name in names:
        _discard(out / name, strict=True)


# ---------------------------------------------------------------------- metrics


def metrics_rows(out: Path) -> int:
    """Number of complete rows in ``metrics.jsonl``."""
    path = out / METRICS_FILE
    if not path.exists():
        return 0
    return sum(1 for line in path.read_bytes().split(b"\n") if line.strip())


def cut_metrics(out: Path, rows: int, update: int) -> None:
    """Process 0: cuts ``metrics.jsonl`` back to its first ``rows`` rows (a checkpoint's)."""
    path = out / METRICS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    keep = [line for line in lines if line.strip()][:rows]
    for i, line in enumerate(keep[:-1]):  # the last one is checked against the update below
        try:
            if not isinstance(json.loads(line), dict):
                raise ValueError("not a row")
        except ValueError:  # edited: a row there would be dropped and the count go wrong
            raise RunDirError(
                f"{path} row {i + 1} is not a JSON row (the file was changed); restore it, or "
                "start over with --overwrite."
            ) from None
    try:
        last = json.loads(keep[-1]).get("update") if keep else 0
    except (ValueError, AttributeError):  # a row cut short or edited into something else
        last = "?"
    if len(keep) < rows or (rows and last != update):
        raise RunDirError(
            f"{path} has {len(keep)} rows ending at update {last}, but checkpoint "
            f"{_name(update)} was written after {rows} rows ending at update {update}; the file "
            "was changed. Restore it, or start over with --overwrite."
        )
    _atomic_write(path, "".join(line + "\n" for line in keep))


# ---------------------------------------------------------------------- checkpoints


def checkpoints(out: str | os.PathLike) -> list[Path]:
    """Checkpoint directories in ``out``, oldest first (whole ones: orbax renames when done)."""
    out = Path(out)
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if _CKPT.match(p.name) and p.is_dir())


def save(
    out: Path, state: Any, *, run_id: str, rows: int, config: dict[str, Any], keep: int = 2
) -> Path:
    """Writes ``state`` to ``out/ckpt_<update>``; collective (every process calls it).

    Keeps the ``keep`` newest checkpoints. Returns the checkpoint's path.
    """
    import jax

    from ensemble.distributed import save_checkpoint

    update = int(jax.device_get(state.update))
    path = out / _name(update)
    meta = {
        "format": FORMAT,
        "run_id": run_id,
        "update": update,
        "metrics_rows": rows,
        "config": config,
        "checksums": fingerprints(state),
        "prng_impl": str(jax.config.jax_default_prng_impl),  # the random streams' generator
    }
    if not path.exists():  # it exists only if this exact state was saved already
        save_checkpoint(path, state, metadata=meta)
    if jax.process_index() == 0:
        for old in checkpoints(out)[:-keep]:
            _discard(old)
        _clean_leftovers(out)
    return path


def restore_targets(learner: Any) -> Any:
    """The train state's shapes, dtypes and shardings: the ``like`` of :func:`restore_latest`."""
    import jax

    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        learner.state_shapes(),
        learner.state_shardings(),
    )


class ConfigChanged(RunDirError):
    """A checkpoint written with another config than ``run.json`` holds (edited by hand), or
    with 64-bit leaves that this process cannot hold (``jax_enable_x64`` off): the checkpoint
    is fine, so older ones are not tried."""


def restore_latest(
    out: Path,
    record: dict[str, Any],
    like: Any,
    warn: Callable[[str], None],
    set_aside: bool = True,
    keys_as_saved: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """The newest checkpoint of the run ``record`` (its ``run.json``) that restores whole, and
    its metadata.

    ``like``: ``jax.ShapeDtypeStruct`` leaves with shardings (each leaf goes straight onto its
    devices). A checkpoint that fails (unreadable, another run, checksum mismatch) is reported
    through ``warn`` in one line and the previous one is tried; those newer than the one used
    are renamed ``*.unreadable`` (kept, out of the way of new checkpoints) unless
    ``set_aside=False`` (a reader, such as an export, that must not change the run). A
    checkpoint written with another config than ``record``'s is :class:`ConfigChanged` (the
    checkpoint is fine; ``run.json`` was changed), as is one whose PRNG keys another generator
    made, unless ``keys_as_saved`` (a reader that needs no keys: they are read as saved).
    Collective.
    """
    from ensemble._distributed import orbax_logs_held

    tried = []
    found = checkpoints(out)
    for i in range(len(found) - 1, -1, -1):
        path = found[i]
        try:
            with orbax_logs_held(logging.WARNING):  # a damaged one: the warning below says it
                state, meta = _restore_one(path, record, like, keys_as_saved)
            reason = "failed on another process"
        except ConfigChanged:
            raise
        except Exception as e:
            state, reason = None, _one_line(e)
        if _all_processes(state is not None):
            if found[i + 1 :] and set_aside:
                _barrier_then_on_main(functools.partial(_set_aside, found[i + 1 :]))
            return state, meta
        tried.append(path.name)
        warn(f"warning: checkpoint {path} cannot be restored ({reason}); trying the one before.")
    raise NoRestorableCheckpoint(out, tried)


def _restore_one(
    path: Path, record: dict[str, Any], like: Any, keys_as_saved: bool
) -> tuple[Any, dict[str, Any]]:
    import jax

    from ensemble._distributed import DamagedCheckpoint
    from ensemble.distributed import checkpoint_metadata, restore_checkpoint

    try:
        meta = checkpoint_metadata(path)
    except DamagedCheckpoint as e:  # (the path is long)
        unreadable = "its metadata is unreadable (_CHECKPOINT_METADATA)"
        raise RunDirError(unreadable if "missing or damaged" in e.what else e.what) from None
    except ValueError:  # its metadata file missing or damaged (the message's path is long)
        raise RunDirError("its metadata is unreadable (_CHECKPOINT_METADATA)") from None
    if meta.get("run_id") is None:
        raise RunDirError("its metadata is unreadable or has no run id")
    if meta.get("run_id") != record["run_id"]:
        raise RunDirError(f"written by run {str(meta.get('run_id'))[:8]}, not this run")
    if _name(int(meta.get("update", -1))) != path.name:
        raise RunDirError(f"its metadata says update {meta.get('update')}")
    # A checkpoint's config may be shorter in total_steps only (the run was extended since).
    diffs = config_differences(meta.get("config") or {}, record["config"])
    if diffs:
        raise ConfigChanged(
            f"{path.parent / RUN_FILE} does not hold the config checkpoint {path.name} was "
            f"written with (checkpoint -> {RUN_FILE}: {diffs}); it was changed by hand. Put "
            "the checkpoint's values back: a run's config cannot change (only --total-steps "
            "may grow by a resume), a new config is a new run."
        )
    generator, ours = meta.get("prng_impl"), str(jax.config.jax_default_prng_impl)
    if generator is not None and generator != ours and not keys_as_saved:
        raise ConfigChanged(
            f"checkpoint {path.name} was written under jax_default_prng_impl {generator}, and "
            f"this process uses {ours}; resume it under the generator it was written with "
            f"(JAX_DEFAULT_PRNG_IMPL={generator}), or its random streams would not continue."
        )
    # Read each leaf in the dtype it was saved in (an older version may have kept another one:
    # uint8 frames were float32), check it against its checksum, then cast it if exact.
    try:
        state = restore_checkpoint(path, _as_saved(path, like, keys_as_saved))
    except DamagedCheckpoint as e:  # (its message's path is long)
        raise RunDirError(f"checksum mismatch in {e.leaves[:3]}" if e.leaves else e.what) from None
    sums = fingerprints(state)
    if sums != meta.get("checksums"):
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(like)]
        bad = [p for p, a, b in zip(paths, sums, meta.get("checksums") or []) if a != b]
        raise RunDirError(f"checksum mismatch in {bad[:3] or 'the leaf list'}")
    if int(jax.device_get(state.update)) != meta["update"]:
        raise RunDirError(f"its state is at update {int(state.update)}")
    return _cast_exactly(state, like), meta


def _as_saved(path: Path, like: Any, keys_as_saved: bool = False) -> Any:
    """``like`` with each leaf's dtype as saved in the checkpoint at ``path`` (and PRNG keys of
    the other generator's width as saved, with ``keys_as_saved``; else that is refused)."""
    import jax

    from ensemble._distributed import _path_names, stored_metadata

    saved = stored_metadata(os.path.abspath(path)).item_metadata  # leaves named as there
    dtypes = {_path_names(p): m.dtype for p, m in jax.tree_util.tree_leaves_with_path(saved)}
    wide = sorted("/".join(map(str, name)) for name, d in dtypes.items()
                  if jax.numpy.dtype(d).itemsize == 8)  # fmt: skip
    if wide and not jax.config.jax_enable_x64:  # read as 32 bits, they would fail their checksum
        raise ConfigChanged(
            f"checkpoint {path.name} holds 64-bit leaves ({', '.join(wide[:3])}: an env whose "
            "state is float64 / int64 under jax_enable_x64, as gymnax's), written with x64 on; "
            "resume or export it with x64 on too (JAX_ENABLE_X64=1)."
        )

    shapes = {_path_names(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(saved)}
    other = _other_key_width(path, like, shapes)
    if other and not keys_as_saved:
        raise _key_width_changed(path, next(iter(other.values()))[-1])

    def one(p, x):
        dtype = dtypes.get(_path_names(p), x.dtype)
        shape = other.get(_path_names(p), x.shape)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=x.sharding)

    return jax.tree_util.tree_map_with_path(one, like)


def _other_key_width(path: Path, like: Any, shapes: dict) -> dict:
    """Raw PRNG keys are 2 uint32 words (threefry) or 4 (rbg, unsafe_rbg), as
    ``jax_default_prng_impl`` makes them: ``{leaf name: saved shape}`` of the key leaves the
    checkpoint holds in the other width. The checkpoint is fine, but this process cannot
    continue its random streams (a reader that needs no keys reads them as saved)."""
    import jax

    from ensemble._distributed import _path_names

    other = {}
    for p, x in jax.tree_util.tree_leaves_with_path(like):
        saved = shapes.get(_path_names(p))
        if x.dtype == "uint32" and saved and saved[:-1] == x.shape[:-1]:
            if {saved[-1], x.shape[-1]} == {2, 4}:
                other[_path_names(p)] = saved
    return other


def _key_width_changed(path: Path, words: int) -> ConfigChanged:
    kind = "threefry2x32" if words == 2 else "rbg or unsafe_rbg"
    return ConfigChanged(
        f"checkpoint {path.name} holds PRNG keys of {words} words, written under "
        f"jax_default_prng_impl {kind}, and this process makes keys of {6 - words}; resume it "
        "under the generator it was written with (JAX_DEFAULT_PRNG_IMPL)."
    )


def _cast_exactly(state: Any, like: Any) -> Any:
    """``state``'s leaves in ``like``'s dtypes; a leaf whose values the cast would change is an
    error (the checkpoint's values cannot be this version's state)."""
    import jax
    import jax.numpy as jnp

    def one(p, x, want):
        if x.dtype == want.dtype:
            return x
        cast = jax.jit(lambda v: v.astype(want.dtype), out_shardings=want.sharding)(x)
        exact = jax.jit(lambda a, b: jnp.array_equal(a.astype(b.dtype), b))(cast, x)
        if not bool(exact):
            raise RunDirError(
                f"{jax.tree_util.keystr(p)} was saved as {x.dtype} and its values do not fit "
                f"{want.dtype}"
            )
        return cast

    return jax.tree_util.tree_map_with_path(one, state, like)


def fingerprints(tree: Any) -> list[list[int]]:
    """Per leaf, one 32-bit checksum per member (row of the leading axis); collective.

    Computed where the shards live (only ``[n]`` numbers come back), position-weighted over the
    raw bits, so a zeroed, truncated or shuffled leaf does not pass for the saved one.
    """
    import jax

    from ensemble._distributed import row_checksums

    return [[int(v) for v in s] for s in row_checksums(jax.tree_util.tree_leaves(tree))]


# ---------------------------------------------------------------------- internals


def _name(update: int) -> str:
    return f"ckpt_{update:08d}"


def _describe(run: RunDir) -> str:
    if run.record is not None:
        cfg = run.record.get("config", {})
        n = len(checkpoints(run.path))
        m = cfg.get("members")
        return (
            f"run {run.record['run_id'][:8]} ({cfg.get('env')}, {m} member{'s' * (m != 1)}, "
            f"{n} checkpoint{'s' * (n != 1)})"
        )
    if run.legacy:
        return "a run with checkpoints of the old npz format (not readable by this version)"
    return "run files (" + ", ".join(p.name for p in run.files[:4]) + ")"


def _discard(path: Path, strict: bool = False) -> None:
    """Deletes a file or directory so it vanishes at once (rename) even if the delete is cut
    short. ``strict``: a rename that fails raises (else that entry stays), one already gone
    does not."""
    trash = path.with_name(f".trash-{uuid.uuid4().hex}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError:
        if strict:
            raise
        return
    delete(trash)


def delete(path: Path) -> None:
    """Deletes a file, link or directory tree, where it is (tolerates its being gone)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _set_aside(paths: list[Path]) -> None:
    for path in paths:
        target = path.with_name(f"{path.name}.unreadable")
        if target.exists():
            _discard(target)
        os.rename(path, target)


def _clean_leftovers(out: Path) -> None:
    for p in out.iterdir():
        if _LEFTOVER.match(p.name):
            delete(p)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise named(e, path) from None


def named(e: OSError, path: Path) -> OSError:
    """``e`` naming ``path`` (a failed ``write`` names no file: 'File too large' of what?)."""
    if e.filename is not None:
        return e
    return type(e)(e.errno, e.strerror or str(e), str(path))


def _one_line(e: BaseException) -> str:
    """The gist of an error: its first line, without TensorStore's long details."""
    lines = str(e).strip().splitlines()
    first = (lines[0] if lines else "").split(" See full TensorStore details")[0][:160]
    return first if isinstance(e, RunDirError) else f"{type(e).__name__}: {first}"


def _all_processes(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (all must agree on which checkpoint to use)."""
    import jax

    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _barrier_then_on_main(fn: Callable[[], Any]) -> None:
    """Runs ``fn`` on process 0 once every process got here (all reads are done)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("rollout.ppo restore done")
    if jax.process_index() == 0:
        fn()
