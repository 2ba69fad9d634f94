"""Runs of rollout.ppo never lose or mix data: run identity, resume, damaged checkpoints, CLI
mistakes, signals, and SIGKILL at random points (between and during checkpoint writes).

In-process tests share one tiny learner per config (compiles are the slow part); anything that
sends a signal runs the CLI in a subprocess under a hard timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import wandb_file
from jax_events import count_compiles
from subprocess_env import clean_env

from ensemble.distributed import checkpoint_metadata
from rollout.ppo import Learner, PPOConfig, export, main, train
from rollout.ppo import _checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]


# A failed orbax restore (the damaged-checkpoint test) leaves its read coroutines un-awaited;
# they are collected later, in whichever test of this module runs next. Only those are ignored.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <coroutine object _read_array_index_and_device_put"
    ":pytest.PytestUnraisableExceptionWarning"
)


def _tiny(**kw) -> PPOConfig:
    base = dict(
        members=2,
        num_envs=2,
        num_steps=16,
        update_epochs=1,
        num_minibatches=2,
        total_steps=6 * 32,
        updates_per_call=1,
    )
    base.update(kw)
    return PPOConfig.for_env("cartpole", **base)


_LEARNERS: dict[PPOConfig, Learner] = {}


def _learner(cfg: PPOConfig) -> Learner:
    if cfg not in _LEARNERS:
        _LEARNERS[cfg] = Learner(cfg, devices=jax.devices()[:2])
    return _LEARNERS[cfg]


def _run(cfg, out, **kw):
    return train(cfg, out, progress=False, learner=_learner(cfg), checkpoint_every=1, **kw)


class _Stop(Exception):
    pass


def _stop_at(update: int):
    def hook(row):
        if row["update"] == update:
            raise _Stop

    return hook


def _strip(rows):
    return [{k: v for k, v in r.items() if k != "env_steps_per_s"} for r in rows]


def _metrics(out: Path):
    return _strip(json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted tiny run (seed 0): final state and metric rows."""
    out = tmp_path_factory.mktemp("reference")
    state, rows = _run(_tiny(), out)
    return jax.device_get(state), _strip(rows)


# ---------------------------------------------------------------------- run identity


def test_fresh_run_refuses_a_dir_with_another_run_and_resume_never_mixes_runs(tmp_path, reference):
    out = tmp_path / "run"
    old = _tiny(seed=1)
    _run(old, out)  # an older run, complete, with its checkpoints
    old_id = json.loads((out / "run.json").read_text())["run_id"]
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ckpt.RunDirError, match=r"already holds run .*resume=True.*overwrite=True"):
        _run(_tiny(), out)
    assert sorted(p.name for p in out.iterdir()) == before  # nothing touched

    # --overwrite: the old run's files go; a new run starts, is killed, and resumes from ITS
    # checkpoint (not the older run's newer one), ending exactly like the uninterrupted run.
    (out / "notes.txt").write_text("mine")  # not a run file: never removed
    with pytest.raises(_Stop):
        _run(_tiny(), out, overwrite=True, on_update=_stop_at(3))
    record = json.loads((out / "run.json").read_text())
    assert record["run_id"] != old_id and record["config"]["seed"] == 0
    assert [p.name for p in ckpt.checkpoints(out)] == ["ckpt_00000001", "ckpt_00000002"]
    state, _ = _run(_tiny(), out, resume=True)
    chex.assert_trees_all_equal(jax.device_get(state), reference[0])
    assert _metrics(out) == reference[1]
    assert (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [".lock"]  # no leftovers


def test_a_run_dir_has_one_writer_at_a_time(tmp_path, capsys):
    out = tmp_path / "run"
    _run(_tiny(), out)
    held = ckpt.lock(out)  # as a run still going in another process would
    try:
        with pytest.raises(ckpt.RunDirError, match=r"in use by another running process"):
            _run(_tiny(), out, resume=True)
        # The CLI says so in its one line, before its banner or any compile.
        line = _cli_error(["--out", str(out), "--resume"], capsys)
        assert "in use by another running process" in line
    finally:
        held.close()
    _run(_tiny(), out, resume=True)  # free again
    # A run that has not written its first checkpoint yet: in use, not "stopped before one".
    young = tmp_path / "young"
    held = ckpt.lock(young)
    try:
        shutil.copy(out / "run.json", young / "run.json")
        line = _cli_error(["--out", str(young), "--resume"], capsys)
        assert "in use by another running process" in line
    finally:
        held.close()


def test_overwrite_removes_an_old_runs_logs_only_under_the_run_dirs_lock(tmp_path, capsys,
                                                                         monkeypatch):  # fmt: skip
    """A resume of the old run that took the lock just after the CLI's early check found its
    TensorBoard events and W&B run id removed by the --overwrite that was then refused."""
    out = tmp_path / "run"
    _run(_tiny(), out)
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1").write_text("old run")
    (out / "wandb_run_id").write_text("abc123")
    monkeypatch.setattr(ckpt, "check_unlocked", lambda out: None)  # the race: it passed
    held = ckpt.lock(out)  # ... and then the old run's resume took the lock
    try:
        line = _cli_error(["--out", str(out), "--overwrite"], capsys)
        assert "in use by another running process" in line
    finally:
        held.close()
    assert (out / "tensorboard" / "events.out.tfevents.1").read_text() == "old run"
    assert (out / "wandb_run_id").read_text() == "abc123"


def test_resume_without_a_checkpoint_refuses_and_keeps_the_metrics(tmp_path):
    out = tmp_path / "exp --out --resume"  # the advice is in Python terms, the path as it is
    with pytest.raises(ckpt.RunDirError, match=r"nothing to resume in out=.*/exp --out --resume "
                       r"\(no run.json\); drop resume=True"):  # fmt: skip
        _run(_tiny(), out, resume=True)
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"update": 1}\n')
    with pytest.raises(ckpt.RunDirError, match=r"no run.json"):
        _run(_tiny(), out, resume=True)
    with pytest.raises(ckpt.RunDirError, match=r"already holds run files \(metrics.jsonl\)"):
        _run(_tiny(), out)
    # A run killed before its first checkpoint: run.json and rows, nothing to resume from.
    (out / "metrics.jsonl").unlink()
    with pytest.raises(_Stop):
        train(_tiny(), out, progress=False, learner=_learner(_tiny()), on_update=_stop_at(2))
    rows = (out / "metrics.jsonl").read_text()
    with pytest.raises(ckpt.RunDirError, match=r"no checkpoint .*overwrite=True"):
        _run(_tiny(), out, resume=True)
    assert (out / "metrics.jsonl").read_text() == rows
    with pytest.raises(ckpt.RunDirError) as e:  # a fresh run there: --resume would not work
        _run(_tiny(), out)
    assert "resume=True" not in str(e.value) and "overwrite=True" in str(e.value)


def test_a_metrics_row_cut_short_by_hand_is_named_and_an_unwritable_lock_is_one_line(tmp_path):
    out = tmp_path / "run"
    _run(_tiny(total_steps=2 * 32), out)
    path = out / "metrics.jsonl"
    path.write_text(path.read_text()[:-20] + "\n")  # the checkpoint's last row, cut short
    with pytest.raises(ckpt.RunDirError, match=r"ending at update \?.*the file was changed"):
        _run(_tiny(total_steps=3 * 32), out, resume=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ckpt.RunDirError, match=r"is not a writable directory"):
        ckpt.lock(tmp_path / "file" / "run")


def test_old_npz_runs_are_named_not_misread(tmp_path):
    (tmp_path / "ckpt_00000004").mkdir(parents=True)
    (tmp_path / "ckpt_00000004" / "state.npz").write_bytes(b"PK")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ckpt.RunDirError, match="old npz format"):
        _run(_tiny(), tmp_path, resume=True)
    with pytest.raises(ckpt.RunDirError, match="old npz format") as info:
        _run(_tiny(), tmp_path)
    assert "resume=True" not in str(info.value)  # it cannot be resumed: not offered


def test_a_hand_edited_run_json_is_named_not_resumed_under_another_config(tmp_path):
    """A resume builds the run from run.json; every checkpoint records the config it was
    written with, so an edited run.json is refused naming the field, not trained on silently
    (gamma) nor taken for damaged checkpoints (a shape), and the checkpoints stay as they are."""
    out = tmp_path / "run"
    _run(_tiny(total_steps=2 * 32), out)
    text = (out / "run.json").read_text()
    record = json.loads(text)
    for key, value in (("gamma", 0.5), ("hidden", [32, 32])):
        edited = {**record, "config": {**record["config"], key: value}}
        (out / "run.json").write_text(json.dumps(edited))
        with pytest.raises(ckpt.ConfigChanged, match=rf"checkpoint -> run.json: {key} .+ -> "):
            _run(PPOConfig.from_dict(edited["config"]), out, resume=True)
        # The export reads the run too: the same words, none of them a training flag.
        with pytest.raises(ckpt.ConfigChanged, match=r"^\S+run.json does not hold the config"):
            export.export_run(out, tmp_path / "export")
        assert sorted(p.name for p in out.iterdir() if "ckpt" in p.name) == [
            "ckpt_00000001",
            "ckpt_00000002",
        ]
    (out / "run.json").write_text(text)  # as it was: the older checkpoints' shorter total_steps
    _run(_tiny(total_steps=3 * 32), out, resume=True)  # are the run growing, not an edit


def test_a_run_json_field_of_another_type_is_one_line(tmp_path):
    """Fields read before the config is built: "devices": "two" was Python's ValueError on a
    resume, "config": "x" an AttributeError (a traceback from the export), and "devices": 1.5
    resumed on 1 device."""
    out = tmp_path / "run"
    _run(_tiny(total_steps=2 * 32), out)
    record = json.loads((out / "run.json").read_text())
    for key, value, said in (
        ("devices", "two", "devices 'two' is not a device count"),
        ("devices", 1.5, "devices 1.5 is not a device count"),
        ("devices", True, "devices True is not a device count"),
        ("config", "x", "config 'x' is not a JSON object of settings"),
        ("run_id", 7, "run_id 7 is not the run's id, a string"),
        ("platform", ["cpu"], "platform ['cpu'] is not a platform name"),
    ):
        (out / "run.json").write_text(json.dumps({**record, key: value}))
        with pytest.raises(ckpt.RunDirError, match=re.escape(f"is unreadable ({said}")):
            ckpt.inspect(out)
        with pytest.raises(export.NotAnExport, match=re.escape(f"({said}); restore it.")):
            export.export_run(out, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_a_damaged_metrics_row_is_named_and_a_failed_write_leaves_nothing_behind(
    tmp_path, monkeypatch
):
    out = tmp_path / "run"
    _run(_tiny(total_steps=2 * 32), out)
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines()
    text = "\n".join([lines[0][:15], *lines[1:]]) + "\n"  # not the last row: the count goes wrong
    path.write_text(text)
    with pytest.raises(ckpt.RunDirError, match=r"metrics.jsonl row 1 is not a JSON row"):
        _run(_tiny(total_steps=3 * 32), out, resume=True)
    assert path.read_text() == text
    path.write_text("\n".join(lines) + "\n")
    # A write that fails (a full disk) names its file and leaves no temporary file; those a
    # kill left behind go at the next save.
    left = [out / f".metrics.jsonl.{'a' * 32}", out / f".trash-{'b' * 32}"]
    for p in left:
        p.write_text("x")

    def full(*args):
        raise OSError(27, "File too large")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", full)
        with pytest.raises(OSError, match=r"File too large: .*metrics.jsonl'"):
            _run(_tiny(total_steps=3 * 32), out, resume=True)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == sorted(
        [".lock", *(p.name for p in left)]
    )
    (out / "ckpt_00000007.orbax-checkpoint-tmp").mkdir()  # a save killed midway
    _run(_tiny(total_steps=3 * 32), out, resume=True)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".lock"]
    assert not (out / "ckpt_00000007.orbax-checkpoint-tmp").exists()


def test_unreadable_or_missing_places_are_one_line(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _run(_tiny(total_steps=2 * 32), out)
    exists = Path.exists

    def no_access(self):  # a checkpoint made unreadable (chmod 000; root ignores modes)
        if self.name == "state.npz":
            raise PermissionError(13, "Permission denied", str(self))
        return exists(self)

    with monkeypatch.context() as m:
        m.setattr(Path, "exists", no_access)
        assert not ckpt.inspect(out).legacy and ckpt.inspect(out).record is not None
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(ckpt.RunDirError, match=r"is a link to .*gone, which does not exist"):
        _run(_tiny(total_steps=2 * 32), tmp_path / "link")


# ---------------------------------------------------------------------- damaged checkpoints


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "zero":
        path.write_bytes(bytes(len(data)))
    elif how == "garble":
        path.write_bytes(bytes(b ^ 0x5A if i % 5 == 0 else b for i, b in enumerate(data)))
    elif how == "flip":  # one bit in the middle
        b = bytearray(data)
        b[len(b) // 2] ^= 0x01
        path.write_bytes(bytes(b))
    elif how == "delete":
        path.unlink()


def _largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.timeout(300)
# The failed restore's event loop closes with a callback of orbax's still queued on it; Python
# reports that as "Exception ignored in: None" (RuntimeError: Event loop is closed).
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. None:pytest.PytestUnraisableExceptionWarning"
)
def test_a_damaged_checkpoint_is_reported_in_one_line_and_the_previous_one_used(
    tmp_path, reference
):
    cut = tmp_path / "cut"
    with pytest.raises(_Stop):
        _run(_tiny(), cut, on_update=_stop_at(5))  # checkpoints 3 and 4 exist
    cases = [
        ("data", "truncate"),
        ("data", "zero"),
        ("data", "garble"),
        ("data", "flip"),
        ("data", "delete"),
        ("_METADATA", "garble"),
        ("manifest.ocdbt", "delete"),
        ("_CHECKPOINT_METADATA", "zero"),
        ("all", "delete"),
    ]
    for where, how in cases:
        out = tmp_path / f"{where}-{how}"
        shutil.copytree(cut, out)
        newest = ckpt.checkpoints(out)[-1]
        if where == "all":
            shutil.rmtree(newest)
        else:
            _damage(_largest_file(newest) if where == "data" else newest / where, how)
        notes: list[str] = []
        state, _ = _run(_tiny(), out, resume=True, warn=notes.append)
        chex.assert_trees_all_equal(jax.device_get(state), reference[0])
        assert _metrics(out) == reference[1], (where, how)
        if where != "all":
            assert len(notes) == 1 and "\n" not in notes[0], notes
            assert f"checkpoint {newest} cannot be restored" in notes[0], notes
            if where == "_CHECKPOINT_METADATA":  # not "written by another run"
                assert "its metadata is unreadable" in notes[0], notes
            assert (out / f"{newest.name}.unreadable").is_dir()  # kept, out of the way

    # Nothing restores: a clear error, and the files stay as they are.
    out = tmp_path / "none"
    shutil.copytree(cut, out)
    for c in ckpt.checkpoints(out):
        _damage(_largest_file(c), "zero")
    with pytest.raises(ckpt.RunDirError, match=r"no checkpoint in .* can be restored"):
        _run(_tiny(), out, resume=True, warn=lambda line: None)
    assert len(ckpt.checkpoints(out)) == 2


@pytest.mark.timeout(300)
def test_a_damaged_sharding_record_leaves_the_checkpoint_in_use(tmp_path, reference):
    """``_sharding`` (orbax's record of the shardings a checkpoint was written with) is never
    needed to restore into given shardings; damaged but still valid JSON (a key renamed by a
    flipped bit), orbax's metadata read raised a KeyError and the intact checkpoint was set
    aside (with one checkpoint, the run could not be resumed at all)."""
    cut = tmp_path / "cut"
    with pytest.raises(_Stop):
        _run(_tiny(), cut, on_update=_stop_at(5))
    renamed = lambda text: text.replace("sharding_type", "shaRding_type")
    for name, damage in [("renamed", renamed), ("not-json", lambda text: text[: len(text) // 2])]:
        out = tmp_path / name
        shutil.copytree(cut, out)
        record = ckpt.checkpoints(out)[-1] / "_sharding"
        record.write_text(damage(record.read_text()))
        notes: list[str] = []
        state, _ = _run(_tiny(), out, resume=True, warn=notes.append)
        chex.assert_trees_all_equal(jax.device_get(state), reference[0])
        assert _metrics(out) == reference[1]
        assert notes == [] and not list(out.glob("*.unreadable")), notes


def test_checkpoints_are_member_sharded_and_record_the_metric_rows(tmp_path):
    out = tmp_path / "run"
    state, _ = _run(_tiny(), out)
    meta = checkpoint_metadata(ckpt.checkpoints(out)[-1])
    assert meta["update"] == 6 and meta["metrics_rows"] == 6
    assert meta["run_id"] == json.loads((out / "run.json").read_text())["run_id"]
    # One checksum per member for every member-shaped leaf, equal to a numpy recomputation.
    leaves = jax.tree_util.tree_leaves(jax.device_get(state))
    assert [len(s) for s in meta["checksums"]] == [
        max(1, np.ndim(x) and x.shape[0]) for x in leaves
    ]
    for x, sums in zip(leaves, meta["checksums"]):
        assert sums == _numpy_checksum(np.asarray(x))
    # Restoring puts every leaf straight onto its member shard.
    learner = _learner(_tiny())
    like = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        learner.state_shapes(),
        learner.state_shardings(),
    )
    record = json.loads((out / "run.json").read_text())
    back, _ = ckpt.restore_latest(out, record, like, warn=print)
    same = jax.tree_util.tree_map(lambda a, s: a.sharding == s, back, learner.state_shardings())
    assert all(jax.tree_util.tree_leaves(same))


def test_a_leaf_saved_in_another_dtype_restores_when_its_values_fit(tmp_path):
    """A checkpoint from a version that kept a leaf in another dtype (uint8 frames were float32):
    read as saved, checked against its checksums, then cast, or refused if the values change."""
    out = tmp_path / "run"
    state, _ = _run(_tiny(), out)
    record = json.loads((out / "run.json").read_text())
    learner = _learner(_tiny())
    like = ckpt.restore_targets(learner)

    def save_with_update(value):
        old = state.replace(update=jnp.asarray(value, jnp.float32))  # int32 in this version
        shutil.rmtree(ckpt.checkpoints(out)[-1])
        ckpt.save(out, old, run_id=record["run_id"], rows=6, config=record["config"])

    save_with_update(6.0)
    back, _ = ckpt.restore_latest(out, record, like, warn=print)
    assert back.update.dtype == jnp.int32 and int(back.update) == 6
    chex.assert_trees_all_equal(jax.device_get(back), jax.device_get(state))
    save_with_update(6.5)  # int(6.5) is still update 6: only the cast can tell
    lines = []
    back, _ = ckpt.restore_latest(out, record, like, warn=lines.append)
    assert int(back.update) == 5  # the one before
    assert lines == [
        f"warning: checkpoint {out / 'ckpt_00000006'} cannot be restored (.update was saved as "
        "float32 and its values do not fit int32); trying the one before."
    ]


def _numpy_checksum(x: np.ndarray) -> list[int]:
    """The checksum of ``ckpt.fingerprints`` computed another way (numpy, uint64 then mod)."""
    if x.dtype == bool:
        bits = x.astype(np.uint64)
    else:
        bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(np.uint64)
    rows = bits.reshape(1, -1) if x.ndim == 0 else bits.reshape(x.shape[0], -1)
    w = (np.arange(rows.shape[1], dtype=np.uint64) * 2654435761 + 1) % 2**32
    mixed = rows ^ (rows >> 16)
    return [int(v) for v in ((mixed * w) % 2**32).sum(axis=1) % 2**32]


# ---------------------------------------------------------------------- longer runs


def test_resume_may_extend_total_steps_and_the_lr_schedule_follows_the_new_total(tmp_path):
    out = tmp_path / "run"
    short, longer = _tiny(), _tiny(total_steps=10 * 32)
    _run(short, out)
    with pytest.raises(ckpt.RunDirError, match=r"\(gamma 0.99 -> 0.9, seed 0 -> 3\)"):
        _run(_tiny(gamma=0.9, seed=3), out, resume=True)
    _, rows = _run(longer, out, resume=True)
    assert json.loads((out / "run.json").read_text())["config"]["total_steps"] == 10 * 32
    assert [r["update"] for r in rows] == list(range(1, 11))
    # Linear annealing to 0: update u (1-based) uses lr0 * (1 - (u - 1) / N), N the total in
    # force when it ran: 6 updates for the first run, 10 after the extension.
    lr0 = short.learning_rate
    want = [lr0 * (1 - (u - 1) / (6 if u <= 6 else 10)) for u in range(1, 11)]
    got = [r["learning_rate"][0] for r in rows]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # Shrinking it back is refused.
    with pytest.raises(ckpt.RunDirError, match=r"\(total_steps 320 -> 192\); only config.total"):
        _run(short, out, resume=True)


def test_runs_that_differ_only_in_total_steps_compile_one_update_program():
    """Where the schedule ends is an input of the update program, not a constant in it: the
    program of a run extended on resume is the program the run compiled, so a new process
    takes it from JAX's persistent compilation cache (it compiled anew for every total)."""
    texts = []
    for cfg in (_tiny(), _tiny(total_steps=10 * 32), _tiny(total_steps=10 * 32, anneal_lr=False)):
        learner = _learner(cfg)
        like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            learner.state_shapes(), learner.state_shardings())  # fmt: skip
        texts.append(learner.lower(like, 2).as_text())
    assert texts[0] == texts[1]
    assert texts[1] != texts[2]  # the text tells programs apart: without annealing, no schedule


# ---------------------------------------------------------------------- the command line


def _cli_error(argv, capsys) -> str:
    """Runs main(argv) in-process; asserts exit 2, no compile; returns the single stderr line."""
    with count_compiles() as compiles:
        try:
            code = main([*argv, "--no-progress"])
        except SystemExit as e:  # argparse
            code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert compiles == [], argv
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_an_unexpected_errors_line_keeps_the_operating_systems_reason():
    """A full disk during a checkpoint: orbax's message names the cause after 300 characters."""
    from rollout.ppo._cli import _os_cause

    long = ValueError("RESOURCE_EXHAUSTED: Error writing " + "x" * 400 + " No space left on device")
    assert _os_cause(long, str(long)[:300]) == " (No space left on device)"
    try:
        try:
            raise OSError(27, "File too large")
        except OSError as inner:
            raise RuntimeError("checkpoint failed") from inner
    except RuntimeError as e:
        assert _os_cause(e, "checkpoint failed") == " (File too large)"
    assert _os_cause(ValueError("bad"), "bad") == ""


def test_the_cli_keeps_jaxs_log_of_a_worker_error_off_stderr(caplog):
    """Each device's failed callback logged the worker's error with its whole traceback before
    the run's one error line (2 to 4 blocks); other records of that logger stay."""
    import logging

    from rollout._pool import WorkerError
    from rollout.ppo._cli import _worker_errors_unlogged

    logger = logging.getLogger("jax._src.callback")

    def log(error):
        try:
            raise error
        except Exception:
            logger.exception("jax.pure_callback failed")

    with caplog.at_level(logging.ERROR, logger="jax._src.callback"):
        with _worker_errors_unlogged():
            log(WorkerError("on_cpu worker 0 was killed"))
            log(ValueError("a bug of the user's"))
        log(WorkerError("outside the CLI"))
    assert [r.exc_info[1].args[0] for r in caplog.records] == [
        "a bug of the user's",
        "outside the CLI",
    ]


def test_cli_mistakes_are_one_line_exit_2_before_any_compile(tmp_path, capsys):
    a_file = tmp_path / "file.txt"
    a_file.write_text("keep me")
    line = _cli_error(["--out", str(a_file)], capsys)
    assert f"--out {a_file} is a file" in line
    assert a_file.read_text() == "keep me"
    with pytest.raises(ckpt.RunDirError, match="is a file"):  # --debug: the real exception
        main(["--out", str(a_file), "--debug"])
    assert "not a writable directory" in _cli_error(["--out", str(a_file / "sub")], capsys)
    assert "not a writable directory" in _cli_error(["--out", "/proc/ppo-run"], capsys)
    assert "--out must name a directory" in _cli_error(["--out", ""], capsys)
    with pytest.raises(ValueError, match="checkpoint_every must be >= 1"):
        train(_tiny(), tmp_path / "api", checkpoint_every=0)
    assert not (tmp_path / "api").exists()
    out = str(tmp_path / "run")
    assert "nothing to resume" in _cli_error(["--out", out, "--resume"], capsys)
    assert "not allowed with argument" in _cli_error(
        ["--out", out, "--resume", "--overwrite"], capsys
    )
    assert "'abc' is not a number" in _cli_error(["--out", out, "--lr", "abc"], capsys)
    # argparse reads a value that starts with '-' as a flag: the line says how to give it.
    line = _cli_error(["--out", out, "--pbt", "--pbt-factors", "-1,2"], capsys)
    assert "expected one argument (if its value starts with '-', write --pbt-factors=" in line
    assert "--checkpoint-every must be >= 1, got 0" in _cli_error(
        ["--out", out, "--checkpoint-every", "0"], capsys
    )
    assert "members must be a positive integer" in _cli_error(
        ["--out", out, "--members", "0"], capsys
    )
    # A mistyped prime: the device search ran through every number up to it, deaf to SIGTERM.
    assert "members=2305843009213693951 is more than" in _cli_error(
        ["--out", out, "--members", str(2**61 - 1)], capsys
    )
    # Refused by the memory check, which traces the network: the folder made for it goes too,
    # and in a folder of the user's, the lock file the start made there.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for where in (out, str(mine)):
        assert main(["--out", where, "--hidden", "1000000,1000000", "--no-progress"]) == 2
        assert "more than the" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert "learning_rate has 3 values" in _cli_error(
        ["--out", out, "--members", "2", "--lr", "1e-3,2e-3,3e-3"], capsys
    )
    line = _cli_error(["--out", out, "--pbt-interval", "5", "--pbt-window", "2"], capsys)
    assert line == "error: --pbt-interval, --pbt-window only tune --pbt, which this run does " + (
        "not use: add --pbt."
    )
    line = _cli_error(["--out", out, "--members", "2", "--num-processes", "2"], capsys)
    assert "needs the coordinator address" in line and "--coordinator HOST:PORT" in line
    line = _cli_error(["--out", out, "--num-processes", "2", "--process-id", "5",
                       "--coordinator", "localhost:1"], capsys)  # fmt: skip
    assert "process_id=5 must be in 0..num_processes-1" in line
    assert not Path(out).exists()  # nothing written by a refused command


def test_cli_ppo_settings_reach_the_config_and_resume_refuses_their_change(tmp_path, capsys):
    """Every PPOConfig setting has a flag (CleanRL's are the defaults); a bad value is one line,
    and a resume that changes one is refused like any other change."""
    out = tmp_path / "run"
    flags = ["--members", "2", "--num-envs", "2", "--num-steps", "16", "--total-steps", "64"]
    tuned = ["--update-epochs", "2", "--num-minibatches", "2", "--gamma", "0.9", "--gae-lambda",
             "0.8", "--vf-coef", "0.25", "--max-grad-norm", "1.5", "--hidden", "16,8",
             "--no-anneal-lr", "--no-norm-adv", "--no-clip-vloss", "--normalize-obs",
             "--normalize-reward", "--no-bootstrap-truncation"]  # fmt: skip
    assert main(["--out", str(out), *flags, *tuned, "--no-progress"]) == 0
    capsys.readouterr()
    saved = json.loads((out / "run.json").read_text())["config"]
    want = dict(update_epochs=2, num_minibatches=2, gamma=0.9, gae_lambda=0.8, vf_coef=0.25,
                max_grad_norm=1.5, hidden=[16, 8], anneal_lr=False, norm_adv=False,
                clip_vloss=False, normalize_obs=True, normalize_reward=True,
                bootstrap_truncation=False)  # fmt: skip
    assert {k: saved[k] for k in want} == want
    line = _cli_error(["--out", str(out), "--resume", "--gamma", "0.99"], capsys)
    assert "another config (gamma 0.9 -> 0.99)" in line
    for bad, match in [
        (["--gamma", "1.5"], "gamma must be in [0, 1], got 1.5"),
        (["--hidden", "64,0"], "'64,0' is not a list of positive widths like 64,64"),
        (["--lr", "1e-3,,2e-3"], "'1e-3,,2e-3' is not a number or a list"),  # was 2 values
        (["--lr", "1e-46"], "learning_rate must be > 0 (in float32)"),  # 0 there: no training
        (["--max-grad-norm", "1e-46"], "max_grad_norm must be finite and > 0 (in float32)"),
        (["--num-minibatches", "3"], "num_minibatches=3 must divide the batch"),
        (["--max-grad-norm", "0"], "max_grad_norm must be finite and > 0"),
        (["--max-grad-norm", "1e308"], "max_grad_norm must be finite and > 0 (in float32)"),
        (["--lr", "1e308"], "learning_rate must be finite and >= 0 (in float32), got 1e+308"),
        (["--hidden", str(10**20)], "layers of at most 16,777,216 units"),  # OverflowError
        (["--num-envs", str(10**20), "--total-steps", str(10**21)], "transitions per update"),
    ]:
        assert match in _cli_error(["--out", str(tmp_path / "bad"), *flags, *bad], capsys)


def test_a_fresh_run_refuses_another_runs_logs_and_overwrite_removes_them(tmp_path, capsys):
    """Loggers, PBT's plot and the default export are the old run's too: a new run's TensorBoard
    events would show as one curve with them, W&B would continue the old run's id, and
    ``evaluate run/export`` would score the old run's members."""
    old = ("tensorboard/", "wandb/", "wandb_run_id", "export/", "pbt_lineage.png")

    def holding(path, names):
        path.mkdir()
        for name in names:
            if name.endswith("/"):
                (path / name).mkdir()
            else:
                (path / name).write_text("old")
        return path

    for name in ("wandb_run_id", "export/"):  # each alone is refused too
        lone = holding(tmp_path / name.strip("/"), [name])
        assert "--overwrite" in _cli_error(["--out", str(lone), *_CLI_TINY[:-1]], capsys)
    out = holding(tmp_path / "run", old)
    (out / "notes.txt").write_text("mine")
    assert "--overwrite" in _cli_error(["--out", str(out), *_CLI_TINY[:-1]], capsys)
    code = main(["--out", str(out), *_CLI_TINY, "--total-steps", "64", "--overwrite"])
    assert code == 0, capsys.readouterr().err
    assert not any((out / name).exists() for name in old)
    assert (out / "notes.txt").read_text() == "mine"  # not the run's: kept


def test_cli_resume_takes_the_saved_config_and_lists_what_differs(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = _tiny()
    _run(cfg, out)
    line = _cli_error(["--out", str(out), "--members", "4", "--seed", "2"], capsys)
    assert "already holds run" in line and "--resume" in line and "--overwrite" in line
    line = _cli_error(["--out", str(out), "--resume", "--members", "4", "--seed", "2"], capsys)
    assert "(members 2 -> 4, seed 0 -> 2)" in line
    record = json.loads((out / "run.json").read_text())  # as if run on a gymnasium id
    saved_env = {"env": "gymnasium:CartPole-v1", "env_kwargs": {"sutton_barto_reward": True}}
    moved = tmp_path / "gym_run"
    shutil.copytree(out, moved)
    (moved / "run.json").write_text(
        json.dumps({**record, "config": {**record["config"], **saved_env}})
    )
    line = _cli_error(["--out", str(moved), "--resume", "--env", "cartpole"], capsys)
    assert "(env 'gymnasium:CartPole-v1' -> 'cartpole')" in line  # not about its env_kwargs
    # A change that would also break the saved config is named as a change (it gave
    # "learning_rate has 2 values but there are members=4").
    lrs = tmp_path / "lrs_run"
    shutil.copytree(out, lrs)
    lr_record = {**record, "config": {**record["config"], "learning_rate": [1e-3, 2e-3]}}
    (lrs / "run.json").write_text(json.dumps(lr_record))
    line = _cli_error(["--out", str(lrs), "--resume", "--members", "4"], capsys)
    assert "another config (members 2 -> 4); only --total-steps may grow" in line
    # The saved config (and flags equal to it) resume; the run is complete: nothing to do.
    rows = (out / "metrics.jsonl").read_text()
    assert main(["--out", str(out), "--resume", "--members", "2", "--no-progress"]) == 0
    assert (out / "metrics.jsonl").read_text() == rows
    # A per-member list of the saved value is that value.
    lr = f"{cfg.learning_rate},{cfg.learning_rate}"
    assert main(["--out", str(out), "--resume", "--lr", lr, "--no-progress"]) == 0
    assert (
        json.loads((out / "run.json").read_text())["config"]["learning_rate"] == cfg.learning_rate
    )
    # One of another length is not: it was taken as the saved value, and the run resumed.
    capsys.readouterr()
    line = _cli_error(["--out", str(out), "--resume", "--lr", f"{lr},{cfg.learning_rate}"], capsys)
    assert "another config (learning_rate 0.00025 -> [0.00025, 0.00025, 0.00025])" in line
    # So is a setting the run left to the env (None), given as what it resolved to: CartPole
    # normalises neither observations nor rewards ("normalize_obs None -> False" before).
    flags = ["--no-normalize-obs", "--no-normalize-reward", "--no-progress"]
    assert main(["--out", str(out), "--resume", *flags]) == 0, capsys.readouterr().err
    assert json.loads((out / "run.json").read_text())["resolved"] == {
        "normalize_obs": False,
        "normalize_reward": False,
    }
    assert json.loads((out / "run.json").read_text())["config"]["normalize_obs"] is None
    capsys.readouterr()
    line = _cli_error(["--out", str(out), "--resume", "--normalize-obs"], capsys)
    assert "(normalize_obs None -> True)" in line


def test_a_resume_may_give_what_the_envs_defaults_resolved_to_and_resumes_again(tmp_path):
    """``normalize_obs=False`` on a CartPole run of ``None``: the same run. Its checkpoints
    keep run.json's config, so the next resume, in either spelling, takes them."""
    import dataclasses

    out = tmp_path / "run"
    cfg = _tiny()
    _run(cfg, out)
    explicit = dataclasses.replace(cfg, normalize_obs=False, total_steps=8 * 32)
    state, rows = train(explicit, out, resume=True, progress=False, checkpoint_every=1)
    assert len(rows) == 8 and int(state.update) == 8
    assert json.loads((out / "run.json").read_text())["config"]["normalize_obs"] is None
    longer = dataclasses.replace(cfg, total_steps=9 * 32)
    _, rows = train(longer, out, resume=True, progress=False, learner=_learner(longer))
    assert len(rows) == 9
    with pytest.raises(ckpt.RunDirError, match=r"normalize_obs None -> True"):
        train(dataclasses.replace(longer, normalize_obs=True), out, resume=True, progress=False)


def test_a_resumed_cpu_run_keeps_its_devices_and_says_when_they_change(tmp_path, capsys):
    """Members split over other devices compute the same maths with other float rounding: a
    resume takes the run's own device count, and says so when told to use another."""
    out = tmp_path / "run"
    tiny = ["--members", "2", "--num-envs", "2", "--num-steps", "16", "--no-progress"]
    assert main([*tiny, "--out", str(out), "--devices", "1", "--total-steps", "32"]) == 0
    record = json.loads((out / "run.json").read_text())
    assert (record["devices"], record["platform"]) == (1, "cpu")
    capsys.readouterr()
    assert main(["--out", str(out), "--resume", "--total-steps", "64", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "devices=1xcpu" in err and "note:" not in err, err
    argv = ["--out", str(out), "--resume", "--total-steps", "100", "--no-progress"]
    assert main([*argv, "--devices", "2"]) == 0
    err = capsys.readouterr().err
    assert "ran on 1 cpu devices and resumes on 2 cpu devices" in err, err
    assert "note: --total-steps 100 is not a multiple of one update's batch" in err, err
    assert json.loads((out / "run.json").read_text())["devices"] == 1  # the run's own


# ---------------------------------------------------------------------- signals, SIGKILL


def _env(cache: Path | None = None) -> dict[str, str]:
    """The session's compilation cache, or the test's own for runs killed at random points (a
    kill in the middle of a cache write leaves a torn entry)."""
    cached = {} if cache is None else {"JAX_COMPILATION_CACHE_DIR": str(cache)}
    return clean_env(WANDB_MODE="offline", WANDB_SILENT="true", **cached)


# W&B is optional: without it, TensorBoard alone is checked.
_LOGS = "tensorboard,wandb" if importlib.util.find_spec("wandb") else "tensorboard"

_CLI_TINY = ["--members", "2", "--devices", "2", "--num-envs", "2", "--num-steps", "16",
             "--updates-per-call", "1", "--checkpoint-every", "1", "--no-progress"]  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "num_envs, envs, most",
    # Without --num-envs the env's defaults decide, known only once the env is made (which may
    # start JAX): refused before that against the most any default gives.
    [(["--num-envs", "2"], "2 envs", 4), ([], "at most 8 envs by default", 16)],
)
def test_more_devices_than_envs_is_refused_before_jax_makes_them(tmp_path, num_envs, envs, most):
    """--devices 100000 used to build 100,000 CPU devices (19 GB, minutes) before any check."""
    argv = ["--devices", "100000", *num_envs, "--members", "2", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "rollout.ppo", *argv], env=_env(), cwd=ROOT,
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: --devices 100000: more devices than the envs they would step (2 members x "
        f"{envs}); give --devices at most {most}."
    ]


def _start(
    out: Path, *extra: str, total: int = 12, cache: Path | None = None, group: bool = False
) -> subprocess.Popen:
    """The CLI on a tiny run; ``group``: in a process group of its own (pid = group id)."""
    cmd = [sys.executable, "-m", "rollout.ppo", *_CLI_TINY, "--total-steps", str(total * 32)]
    return subprocess.Popen(
        [*cmd, "--out", str(out), *extra],
        cwd=ROOT,
        env=_env(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=group,
    )


def _rows(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _wait(proc: subprocess.Popen, until, timeout: float = 120.0, poll: float = 0.002) -> bool:
    """Polls ``until()`` while ``proc`` runs; False if it ended first."""
    deadline = time.monotonic() + timeout
    while not until():
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(poll)
    return True


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "sig, env, logs",
    [
        (signal.SIGINT, ("--env-on", "cpu"), ()),
        (signal.SIGTERM, ("--env", "gymnasium:CartPole-v1"), ("--log", _LOGS)),
    ],
    ids=["SIGINT-on_cpu-workers", "SIGTERM-host-env-workers"],
)
def test_a_signal_writes_a_checkpoint_and_says_how_to_resume(tmp_path, sig, env, logs):
    """The signal goes to every process of the run, as a terminal's Ctrl-C or a scheduler's
    SIGTERM does: the env workers must leave it to the learner, which checkpoints, then ends
    them. The command it prints keeps the run's loggers (``run.json`` does not record them)."""
    if logs:
        pytest.importorskip("tensorboardX")
    out = tmp_path / "my run"  # the printed command must survive being pasted into a shell
    proc = _start(out, *env, *logs, "--checkpoint-every", "3", total=400, group=True)
    try:
        assert _wait(proc, lambda: _rows(out) >= 2, poll=0.05), proc.communicate()
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
        deadline = time.monotonic() + 10
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(proc.pid), "workers outlived the learner"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(signal.Signals(sig).name), err
    command = shlex.split(last.split("continue with: ")[1])
    want = ["python", "-m", "rollout.ppo", "--resume", "--out", str(out), *logs]
    assert command == [*want, "--checkpoint-every", "3"], last
    newest = ckpt.checkpoints(out)[-1]
    meta = checkpoint_metadata(newest)
    assert meta["metrics_rows"] == meta["update"] == _rows(out)  # rows == the checkpoint's
    assert (out / "learning_curve.png").stat().st_size > 0  # the curves so far
    if logs and "wandb" in _LOGS:  # W&B shows the stopped run as failed, not finished
        assert wandb_file.exit_code(out) == 128 + sig


@pytest.mark.timeout(180)
def test_a_checkpoint_write_that_fails_is_one_line(tmp_path):
    """A full disk while saving: orbax logs the error with a traceback from each of its threads,
    and TensorStore's writes still in flight print into orbax's closed event loop (hundreds of
    lines, by timing); the CLI still says it in its one line."""
    env = clean_env(JAX_ENABLE_COMPILATION_CACHE="false")  # its entries are bigger
    cmd = [sys.executable, "-m", "rollout.ppo", *_CLI_TINY, "--total-steps", str(4 * 32)]
    cmd = shlex.join([*cmd, "--out", str(tmp_path / "run")])
    # Every file it writes stops at 16 KiB: EFBIG, "File too large".
    proc = subprocess.run(
        ["bash", "-c", f"ulimit -f 16 && exec {cmd}"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=150,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ") and "File too large" in lines[-1], lines[-1]
    assert len(lines) <= 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_the_python_apis_resume_hint_names_what_can_resume(tmp_path):
    """The command line can make the config's env again, not a user's env object that the
    config does not make (one it makes alike, envs.make("cartpole"), counts as the config's)."""
    from rollout import envs
    from rollout.ppo._cli import Interrupted

    cfg = _tiny()
    assert Learner(cfg, devices=jax.devices()[:2], env=envs.make("cartpole")).env_from_config
    mine = Learner(cfg, devices=jax.devices()[:2], env=envs.make("cartpole", max_episode_steps=9))
    for learner, hint in (
        (_learner(cfg), "or: python -m rollout.ppo --resume --out"),
        (mine, "resume=True, learner=Learner(config, env=<your env>))"),
    ):
        with pytest.raises(Interrupted) as e:
            train(cfg, tmp_path / hint[:6], progress=False, learner=learner,
                  stop=lambda: signal.SIGTERM)  # fmt: skip
        assert hint in str(e.value), str(e.value)
        assert ("python -m" in str(e.value)) == learner.env_from_config
    mine.close()


def test_a_signal_during_setup_says_the_run_stops_before_its_first_update(capsys):
    """Setup (envs, networks, a restore) is not cut short: the first signal says what happens
    instead of promising the end of an update that has not begun."""
    from rollout.ppo._cli import _Signals

    setting_up, training = _Signals(), _Signals()
    setting_up._handle(signal.SIGTERM, None)
    assert "SIGTERM: still setting up" in capsys.readouterr().err
    assert setting_up.received() == signal.SIGTERM  # the loop's first poll stops the run
    assert training.received() is None
    training._handle(signal.SIGINT, None)
    assert "SIGINT: stopping after the current update" in capsys.readouterr().err


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(600)
def test_sigkill_at_random_points_then_resume_equals_an_uninterrupted_run(tmp_path):
    """3 kills: during a checkpoint write (its temporary directory exists), at a random row,
    after a random delay; each followed by --resume. Final checkpoint and metrics must equal
    those of an uninterrupted run (which checkpoints only at its end: its numbers do not
    depend on when it saves, and its 11 other saves would only cost time)."""
    rng = random.Random(7)
    total, cache = 12, tmp_path / "jax-cache"
    ref = tmp_path / "ref"
    done = subprocess.run(
        [sys.executable, "-m", "rollout.ppo", *_CLI_TINY, "--total-steps", str(total * 32),
         "--out", str(ref), "--checkpoint-every", str(total)],
        cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "run"
    writing = lambda: out.is_dir() and any(".orbax-checkpoint-tmp" in p for p in os.listdir(out))
    kills = []
    for kind in ("during-write", "at-row", "after-delay"):
        resume = ("--resume",) if ckpt.checkpoints(out) else ("--overwrite",)
        proc = _start(out, *resume, total=total, cache=cache)
        try:
            start_rows = _rows(out)
            if kind == "during-write":
                assert _wait(proc, lambda n=start_rows: _rows(out) >= n + 2 and writing())
            elif kind == "at-row":
                target = start_rows + rng.randint(1, 3)
                assert _wait(proc, lambda n=target: _rows(out) >= n)
            else:
                assert _wait(proc, lambda n=start_rows: _rows(out) > n, poll=0.01)
                time.sleep(rng.uniform(0.0, 0.3))
            proc.kill()
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        kills.append((kind, _rows(out), [p.name for p in out.iterdir()]))
    assert _rows(out) < total, kills  # the kills landed before the end

    proc = _start(out, "--resume", total=total, cache=cache)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert _metrics(out) == _metrics(ref), kills
    a, b = (ckpt.checkpoints(d)[-1] for d in (out, ref))
    assert a.name == b.name == f"ckpt_{total:08d}"
    ma, mb = checkpoint_metadata(a), checkpoint_metadata(b)
    assert ma["checksums"] == mb["checksums"], kills  # every leaf, every member, bit for bit
    # And the restored parameters themselves (not only their checksums).
    cfg = PPOConfig.from_dict(json.loads((ref / "run.json").read_text())["config"])
    learner = Learner(cfg, devices=jax.devices()[:2])
    like = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        learner.state_shapes(),
        learner.state_shardings(),
    )
    states = [ckpt.restore_latest(d, json.loads((d / "run.json").read_text()), like, print)[0]
              for d in (out, ref)]  # fmt: skip
    chex.assert_trees_all_equal(*jax.device_get(states))


# ---------------------------------------------------------------------- divergence


@pytest.mark.parametrize("per_call", [1, 3])
def test_a_member_whose_losses_turn_nan_stops_the_run_before_its_state_is_saved(tmp_path, per_call):
    """The rows end at the diverged update, also when the jitted call ran later ones, and have
    the usual keys (with PBT, the hyperparameters the members ran with, as every row)."""
    from rollout import envs
    from rollout.ppo import Diverged

    class NanAtStep7(envs.CartPole):  # the env hands out one NaN reward, 7 steps in
        def step(self, state, action, key, params=None):
            state, obs, reward, term, trunc, info = super().step(state, action, key, params)
            return state, obs, jnp.where(state.t == 7, jnp.nan, reward), term, trunc, info

    pbt = per_call == 3
    cfg = _tiny(updates_per_call=per_call, pbt=pbt, pbt_fraction=0.5, pbt_interval=3)
    learner = Learner(cfg, devices=jax.devices()[:2], env=envs.AutoReset(NanAtStep7()))
    out = tmp_path / "run"
    logged = []  # what --log's loggers get: every row metrics.jsonl gets
    with pytest.raises(Diverged, match=r"diverged at update 1: member\(s\) 0, 1 computed a NaN"):
        train(cfg, out, progress=False, learner=learner, checkpoint_every=1,
              on_update=logged.append)  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1] and rows[0]["policy_loss"] == [None, None]
    assert [r["update"] for r in logged] == [1]
    assert "env_steps_per_s" in rows[0]
    assert ("hparams" in rows[0]) == pbt
    assert ckpt.checkpoints(out) == []  # the NaN state was not saved


def test_logs_a_killed_overwrite_set_aside_are_put_back_by_the_next_start(tmp_path, capsys):
    """An --overwrite killed after it moved the old run's logs aside (before its loggers had
    started, so before it touched the old run) left them hidden; the next start that is not
    an --overwrite puts them back, in place of what the killed start's loggers made."""
    out = tmp_path / "run"
    _run(_tiny(), out)  # complete: a resume has nothing to do
    (out / ".wandb_run_id.overwritten").write_text("abc123")
    (out / ".tensorboard.overwritten").mkdir()
    (out / ".tensorboard.overwritten" / "events.out.tfevents.1").write_text("old run")
    (out / "tensorboard").mkdir()  # the killed start's
    (out / "tensorboard" / "events.out.tfevents.2").write_text("killed start")
    assert main(["--out", str(out), "--resume", "--no-progress"]) == 0, capsys.readouterr().err
    assert not [p.name for p in out.iterdir() if p.name.endswith(".overwritten")]
    assert os.listdir(out / "tensorboard") == ["events.out.tfevents.1"]
    assert (out / "wandb_run_id").read_text() == "abc123"
    # An --overwrite removes such leftovers with the rest of the old run.
    (out / ".wandb.overwritten").mkdir()
    code = main(["--out", str(out), *_CLI_TINY, "--total-steps", "64", "--overwrite"])
    assert code == 0, capsys.readouterr().err
    assert not [p.name for p in out.iterdir() if p.name.endswith(".overwritten")]
    assert not (out / "tensorboard").exists() and not (out / "wandb_run_id").exists()


def test_an_overwrite_that_fails_before_it_removed_the_old_run_puts_its_logs_back(
    tmp_path, capsys, monkeypatch
):
    """Loggers started, then training failed before it removed the old run (here: at the
    start of the new one): the old run is whole, so its set-aside logs come back."""
    out = tmp_path / "run"
    _run(_tiny(), out)
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1").write_text("old run")
    (out / "wandb_run_id").write_text("abc123")

    def fail(*args, **kwargs):
        raise RuntimeError("the disk is full")

    monkeypatch.setattr(ckpt, "start", fail)
    code = main(["--out", str(out), *_CLI_TINY, "--total-steps", "64", "--overwrite",
                 "--log", "tensorboard"])  # fmt: skip
    assert code == 1 and "the disk is full" in capsys.readouterr().err
    assert os.listdir(out / "tensorboard") == ["events.out.tfevents.1"]
    assert (out / "wandb_run_id").read_text() == "abc123"
    assert not [p.name for p in out.iterdir() if p.name.endswith(".overwritten")]


def test_stop_returning_false_goes_on_and_true_stops_as_sigint(tmp_path):
    """``stop=lambda: time.time() > deadline``: False crashed the run (signal.Signals(False):
    "False is not a valid Signals", no checkpoint) and True would have meant SIGHUP."""
    from rollout.ppo._cli import Interrupted

    cfg = _tiny()
    polls = []

    def after_two_calls():
        polls.append(1)
        return np.bool_(len(polls) > 2)  # (np.True_ read as signal 1 would be SIGHUP)

    with pytest.raises(Interrupted) as e:
        _run(cfg, tmp_path / "run", stop=after_two_calls)
    assert e.value.code == 128 + signal.SIGINT and "stopped at update 2/6" in str(e.value)
    assert ckpt.checkpoints(tmp_path / "run")  # stopped with a checkpoint
    with pytest.raises(ValueError, match=r"returned 'soon'; return None or False to go on"):
        _run(cfg, tmp_path / "other", stop=lambda: "soon")
    from rollout.ppo._cli import _as_signal

    sigint = int(signal.SIGINT)  # (a 0-d array read as an enum value was signal 1, SIGHUP)
    assert [_as_signal(v) for v in (jnp.array(True), np.array(True), jnp.any(jnp.ones(2) > 0))] == [
        sigint
    ] * 3
    assert _as_signal(jnp.array(False)) is None and _as_signal(np.int64(15)) == 15
    with pytest.raises(ValueError, match=r"an array of shape \(2,\)"):
        _as_signal(np.array([0, 1]))


def test_a_state_an_update_donated_is_refused_not_a_crash():
    """With JAX 0.10, a program given a donated buffer split over several devices ends the
    process with a segmentation fault: a notebook cell run twice lost the kernel."""
    learner = _learner(_tiny())
    old = learner.init()
    new, _ = learner.update(old, 1)
    with pytest.raises(ValueError, match=r"this state was donated to an earlier update"):
        learner.update(old, 1)
    learner.update(new, 1)  # the returned one goes on


def test_an_interrupt_while_train_closes_its_learner_still_frees_the_run_dir(tmp_path, monkeypatch):
    """A second Ctrl-C landing in train()'s close of the learner it made skipped the close of
    the run, whose lock then lived on in the traceback a notebook keeps: resuming in the same
    session was refused as 'in use by another running process'."""
    from rollout.ppo import _cli

    made = _learner(_tiny())

    class Interrupted:  # the learner train() made, whose close the second Ctrl-C hits
        def __getattr__(self, name):
            return getattr(made, name)

        def close(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(_cli, "_learner_for", lambda *a, **k: Interrupted())
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt) as kept:  # (kept: as a notebook keeps it)
        train(_tiny(), out, progress=False, checkpoint_every=1, on_update=_stop_at(3))
    monkeypatch.undo()
    _, rows = _run(_tiny(), out, resume=True)
    assert kept.value is not None and [r["update"] for r in rows] == list(range(1, 7))
