"""Standard loggers: TensorBoard event files and W&B (offline) hold what metrics.jsonl holds."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import wandb_file
from subprocess_env import clean_env

from rollout.ppo import _loggers


def _cli_env() -> dict[str, str]:
    return clean_env(WANDB_MODE="offline", WANDB_SILENT="true")


# ---------------------------------------------------------------------- readers written here


def _tfrecords(path: Path) -> list[bytes]:
    """Records of a TFRecord file (8-byte length, its masked CRC, data, the data's masked CRC)."""

    def masked_crc32c(data: bytes) -> int:  # the TFRecord format's rotate-and-add mask
        crc = _crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    data, pos, out = path.read_bytes(), 0, []
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header)
        body = data[pos + 12 : pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] == (
            masked_crc32c(body)
        )
        out.append(body)
        pos += 16 + length
    return out


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit: a reference independent of the writer's."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _tensorboard_scalars(directory: Path) -> dict[tuple[str, int], float]:
    from tensorboardX.proto.event_pb2 import Event

    got: dict[tuple[str, int], float] = {}
    files = sorted(directory.glob("events.out.tfevents.*"))
    assert files, f"no event file in {directory}"
    for path in files:
        for record in _tfrecords(path):
            event = Event.FromString(record)
            for value in event.summary.value:
                got[(value.tag, event.step)] = value.simple_value
    return got


# ---------------------------------------------------------------------- units


def test_scalar_names_group_by_member_and_skip_missing_values():
    row = {
        "update": 3,
        "env_steps": 768,
        "returns": [20.0, None, 40.0],
        "value_loss": [1.0, 2.0, float("nan")],
        "env_steps_per_s": None,
    }
    assert _loggers.scalars(row) == {
        "member_0/return": 20.0,
        "member_2/return": 40.0,
        "ensemble/return_mean": 30.0,
        "ensemble/return_min": 20.0,
        "ensemble/return_max": 40.0,
        "member_0/value_loss": 1.0,
        "member_1/value_loss": 2.0,
        "ensemble/value_loss_mean": 1.5,
    }
    assert _loggers.scalars({"env_steps": 1, "returns": [None], "env_steps_per_s": 5.0}) == {
        "perf/env_steps_per_s": 5.0
    }


def test_pbt_hyperparameters_reach_the_loggers_and_parents_get_no_mean():
    # The nested hparams were dropped: the entropy and clip coefficients PBT changes never
    # reached a dashboard; the mean of the parents' member indices was logged.
    row = {"env_steps": 8, "pbt_parent": [1, 1], "hparams": {"ent_coef": [0.01, 0.012]}}
    assert _loggers.scalars(row) == {
        "member_0/pbt_parent": 1.0,
        "member_1/pbt_parent": 1.0,
        "member_0/hparam_ent_coef": 0.01,
        "member_1/hparam_ent_coef": 0.012,
        "ensemble/hparam_ent_coef_mean": 0.011,
    }


# W&B is optional: without it, TensorBoard alone is checked.
_TB_AND_WANDB = "tensorboard,wandb" if importlib.util.find_spec("wandb") else "tensorboard"

NAN_ENV = """
import gymnasium as gym
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

class NanCartPole(CartPoleEnv):  # a NaN reward once this env instance has made 150 steps
    made = 0

    def step(self, action):
        obs, reward, term, trunc, info = super().step(action)
        NanCartPole.made += 1
        return obs, float("nan") if NanCartPole.made > 150 else reward, term, trunc, info

gym.register("NanCartPole-v0", entry_point=NanCartPole, max_episode_steps=500)
"""


@pytest.mark.timeout(240)
def test_a_multi_process_run_that_diverges_hands_every_row_to_its_loggers(tmp_path):
    # A failing process of a multi-process run ends at once, without atexit handlers: the
    # loggers, closed only there, lost the rows they had not written (TensorBoard) or the
    # whole run (W&B offline: an empty file).
    (tmp_path / "nan_cartpole.py").write_text(NAN_ENV)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ensemble.launch", "-n", "2", "--", sys.executable, "-m",
           "rollout.ppo", "--env", "gymnasium:nan_cartpole:NanCartPole-v0", "--members", "2",
           "--num-envs", "2", "--num-steps", "64", "--total-steps", "1024", "--out", str(out),
           "--no-progress", "--log", _TB_AND_WANDB, "--log-interval", "0"]  # fmt: skip
    env = _cli_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 1 and "diverged at update" in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = {step for _, step in _tensorboard_scalars(out / "tensorboard")}
    assert len(rows) >= 2 and logged == {r["env_steps"] for r in rows}, (logged, rows)
    if "wandb" in _TB_AND_WANDB:  # W&B shows the run as failed, not finished
        assert wandb_file.exit_code(out) == 1


def test_a_resumed_run_replaces_the_stopped_runs_events_and_continues_its_wandb_run(
    tmp_path, monkeypatch
):
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    # A run killed after writing 768 steps; its checkpoint was at 512: the resumed run writes
    # 768 again. TensorBoard purges events at or past a session start's step.
    first = _loggers.TensorBoardLogger(tmp_path / "tb")
    for steps in (256, 512, 768):
        first.write({"env_steps": steps, "returns": [1.0]})
    first.close()
    time.sleep(1.1)  # event file names hold the second they were made
    second = _loggers.TensorBoardLogger(tmp_path / "tb")
    for steps in (768, 1024):
        second.write({"env_steps": steps, "returns": [2.0]})
    second.close()
    for path, start in zip(sorted((tmp_path / "tb").glob("events.*")), (256, 768)):
        events = [Event.FromString(r) for r in _tfrecords(path)]
        events = [e for e in events if e.HasField("session_log") or e.HasField("summary")]
        assert events[0].session_log.status == SessionLog.START and events[0].step == start
        assert all(e.step >= start for e in events)

    class FakeWandb:  # records what the logger asks W&B for
        runs: list = []  # noqa: RUF012

        @staticmethod
        def init(**kw):
            FakeWandb.runs.append(kw)

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    for resume in (False, True, False):
        _loggers.WandbLogger(tmp_path / "run", {}, resume)
    ids = [kw["id"] for kw in FakeWandb.runs]
    assert ids[0] == ids[1] != ids[2] and {kw["resume"] for kw in FakeWandb.runs} == {"allow"}


def _shown_by_tensorboard(directory: Path) -> dict[int, float]:
    """member_0/return per step as TensorBoard shows it: files in order, a session start at
    step s dropping what came before at steps >= s."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    shown: dict[int, float] = {}
    for path in sorted(directory.glob("events.*")):
        for record in _tfrecords(path):
            event = Event.FromString(record)
            if event.session_log.status == SessionLog.START:
                shown = {s: v for s, v in shown.items() if s < event.step}
            for value in event.summary.value:
                if value.tag == "member_0/return":
                    shown[event.step] = value.simple_value
    return shown


def test_a_resumed_run_writes_again_the_rows_its_killed_loggers_had_lost(tmp_path, monkeypatch):
    # Killed after 768 steps, its loggers had got only 256 (rows still queued, events not
    # flushed); the checkpoint was at 512, so the resumed run computes 768 on. The rows up to
    # 512 exist only in metrics.jsonl: restore() writes them again.
    first = _loggers.TensorBoardLogger(tmp_path / "tb")
    first.write({"env_steps": 256, "returns": [1.0]})
    first.close()
    time.sleep(1.1)  # event file names hold the second they were made
    restored = [{"env_steps": s, "returns": [1.0]} for s in (256, 512)]
    second = _loggers.TensorBoardLogger(tmp_path / "tb")
    with _loggers.Loggers([second, _Rows()], interval_s=3600) as logs:  # _Rows: no restore()
        logs.restore(restored)
        for steps in (768, 1024):
            logs.write({"env_steps": steps, "returns": [2.0]})
    assert _shown_by_tensorboard(tmp_path / "tb") == {256: 1.0, 512: 1.0, 768: 2.0, 1024: 2.0}

    class FakeRun:  # a resumed online W&B run knows the step after its last; offline: 0
        def __init__(self, step):
            self.step, self.logged = step, []

        def log(self, scalars, step):
            self.logged.append(step)

    for known, want in ((300, [512]), (0, [256, 512])):
        logger = object.__new__(_loggers.WandbLogger)
        logger._run = FakeRun(known)
        logger.restore(restored)
        assert logger._run.logged == want


class _Stop(Exception):
    pass


def test_train_hands_the_restored_rows_to_on_resume(tmp_path):
    """A resume hands ``on_resume`` the rows of its checkpoint: those the stopped run computed
    up to it (row 3, past the last checkpoint, is not restored), then trains on. One learner
    (one compile) serves both runs: the run stops at update 3 instead of being extended."""
    import jax

    from rollout.ppo import Learner, PPOConfig, train

    cfg = PPOConfig.for_env("cartpole", members=2, total_steps=4 * 32, num_envs=2, num_steps=16,
                            updates_per_call=1)  # fmt: skip
    learner = Learner(cfg, devices=jax.devices()[:2])
    seen: list = []

    def stop_at_3(row):
        seen.append(row)
        if row["update"] == 3:
            raise _Stop

    with pytest.raises(_Stop):
        train(cfg, tmp_path / "run", progress=False, checkpoint_every=1, learner=learner,
              on_update=stop_at_3)  # fmt: skip
    rows = seen[:2]  # checkpoints after updates 1 and 2
    got: list = []
    _, more = train(cfg, tmp_path / "run", resume=True, progress=False, learner=learner,
                    on_resume=got.append)  # fmt: skip
    assert got == [rows] and more[: len(rows)] == rows and len(more) > len(rows)
    assert [r["update"] for r in more] == [1, 2, 3, 4]
    learner.close()


def test_log_flag_names_and_errors():
    assert _loggers.parse_log_flag("") == ()
    assert _loggers.parse_log_flag("jsonl,tensorboard,tensorboard") == ("tensorboard",)
    with pytest.raises(ValueError, match=r"unknown logger 'mlflow' in --log; choose from"):
        _loggers.parse_log_flag("tensorboard,mlflow")


def test_failing_logger_is_reported_once_and_dropped(capsys):
    class Broken:
        def __init__(self):
            self.rows, self.closed = 0, False

        def write(self, row):
            self.rows += 1
            raise OSError("disk full")

        def close(self):
            self.closed = True

    class Good:
        def __init__(self):
            self.rows = []

        def write(self, row):
            self.rows.append(row["env_steps"])

        def close(self):
            pass

    broken, good = Broken(), Good()
    with _loggers.Loggers([broken, good], interval_s=0) as logs:
        for step in (1, 2, 3):
            logs.write({"env_steps": step})
    assert good.rows == [1, 2, 3]
    assert broken.rows == 1 and broken.closed
    err = capsys.readouterr().err
    assert err.count("disk full") == 1 and "logger off" in err


class _Rows:
    def __init__(self):
        self.rows, self.closed = [], False

    def write(self, row):
        assert not self.closed
        self.rows.append(row["env_steps"])

    def close(self):
        self.closed = True


def test_log_interval_passes_the_first_row_then_the_last_at_close():
    every, sparse = _Rows(), _Rows()
    with _loggers.Loggers([every], interval_s=0) as a, _loggers.Loggers([sparse], 3600) as b:
        for step in range(1, 8):
            a.write({"env_steps": step})
            b.write({"env_steps": step})
        assert (b.queued, b.skipped) == (1, 6)
    assert every.rows == [1, 2, 3, 4, 5, 6, 7] and every.closed
    # A row waits for the interval; the one kept back last is written at close.
    assert sparse.rows == [1, 7] and sparse.closed and (b.queued, b.skipped) == (2, 5)
    # A PBT step's row always goes: who copied whom is in no other row.
    lineage = _Rows()
    with _loggers.Loggers([lineage], 3600) as c:
        for step in range(1, 8):
            c.write({"env_steps": step, **({"pbt_parent": [0, 0]} if step % 3 == 0 else {})})
    assert lineage.rows == [1, 3, 6, 7]
    with pytest.raises(ValueError, match="interval must be >= 0"):
        _loggers.Loggers([], interval_s=-1)


def test_log_interval_lets_a_row_through_once_the_interval_has_passed():
    got = _Rows()
    with _loggers.Loggers([got], interval_s=0.5) as logs:
        logs.write({"env_steps": 1})
        logs.write({"env_steps": 2})  # within 0.5 s of the first: kept back
        time.sleep(0.6)
        logs.write({"env_steps": 3})
    assert got.rows == [1, 3]


def test_cli_unknown_logger_exits_2_before_training(tmp_path):
    from rollout.ppo import main

    rc = main(["--log", "tensorboard,mlflow", "--out", str(tmp_path / "run"), "--no-progress"])
    assert rc == 2
    assert not (tmp_path / "run").exists()  # nothing started
    for bad in ("-1", "nan"):
        argv = ["--log", "tensorboard", "--log-interval", bad, "--no-progress"]
        rc = main([*argv, "--out", str(tmp_path / "run")])
        assert rc == 2
        assert not (tmp_path / "run").exists()


def test_cli_log_interval_without_log_is_refused(tmp_path, capsys):
    from rollout.ppo import main

    rc = main(["--log-interval", "5", "--out", str(tmp_path / "run"), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--log tensorboard" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
def test_cli_missing_package_exits_2_with_one_line(tmp_path):
    # A None entry in sys.modules makes `import tensorboardX` fail as if it were not installed.
    code = (
        "import sys; sys.modules['tensorboardX'] = None\n"
        "from rollout.ppo import main\n"
        f"raise SystemExit(main(['--log', 'tensorboard', '--out', {str(tmp_path / 'r')!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_cli_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "needs the tensorboardX package" in lines[0]
    assert "pip install 'sharded-ensembles[tensorboard]'" in lines[0]


# ---------------------------------------------------------------------- end to end


def _expected(rows: list[dict]) -> dict[tuple[str, int], float]:
    want = {}
    for row in rows:
        for tag, value in _loggers.scalars(row).items():
            want[(tag, row["env_steps"])] = value
    return want


@pytest.mark.timeout(300)
def test_cli_tensorboard_and_wandb_hold_the_metrics_rows(tmp_path):
    try:  # W&B is optional: without it, TensorBoard alone is checked
        import wandb
    except ImportError:
        wandb = None
    log = "tensorboard,wandb" if wandb is not None else "tensorboard"
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rollout.ppo", "--env", "cartpole", "--members", "2"]
    cmd += ["--total-steps", "1024", "--num-steps", "64", "--updates-per-call", "2"]
    cmd += ["--out", str(out), "--no-progress", "--log", log, "--log-interval", "0"]
    proc = subprocess.run(
        cmd, env=_cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["env_steps"] for r in rows] == [256, 512, 768, 1024]
    want = _expected(rows)
    # Every member's every metric at every update (those with a value) is there.
    assert ("member_1/entropy", 256) in want and ("ensemble/return_mean", 1024) in want

    got = _tensorboard_scalars(out / "tensorboard")
    assert set(got) == set(want)
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-6, abs_tol=1e-12), key

    if wandb is not None:
        history = wandb_file.history(out)
        assert [h["_step"] for h in history] == [r["env_steps"] for r in rows]
        for h, row in zip(history, rows):
            logged = {k: v for k, v in h.items() if not k.startswith("_")}
            assert logged == pytest.approx(_loggers.scalars(row), rel=1e-12)


@pytest.mark.timeout(120)
def test_cli_a_logger_that_cannot_start_is_one_line_and_leaves_no_run_directory(tmp_path):
    # A W&B that refuses to start (online, no login): stand-in module on the import path.
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "wandb.py").write_text(
        "def init(**kw):\n"
        "    raise RuntimeError('api_key not configured (no-tty). call wandb.login')\n"
    )
    out = tmp_path / "runs" / "a" / "run"  # new folders all the way down: none left behind
    cmd = [sys.executable, "-m", "rollout.ppo", "--env", "cartpole", "--members", "2"]
    cmd += ["--total-steps", "1024", "--num-steps", "64", "--out", str(out), "--no-progress"]
    env = _cli_env()
    env["PYTHONPATH"] = os.pathsep.join([str(fake), env.get("PYTHONPATH", "")])
    for log in ("wandb", "tensorboard,wandb"):
        proc = subprocess.run(
            [*cmd, "--log", log], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: --log {log}: api_key not configured (no-tty). call wandb.login"]
        assert not (tmp_path / "runs").exists()  # nothing the next start would have to explain
    # --overwrite of a run whose logs are there: refused, it leaves them as they were (they
    # were removed before the loggers failed to start).
    old = tmp_path / "old"
    (old / "tensorboard").mkdir(parents=True)
    (old / "tensorboard" / "events.out.tfevents.1").write_text("old run")
    (old / "wandb_run_id").write_text("abc123")
    (old / ".wandb.overwritten").mkdir()  # set aside by an --overwrite killed before: it goes
    proc = subprocess.run(  # log: the last, tensorboard,wandb (TensorBoard's files come first)
        [*cmd[:-3], "--out", str(old), "--no-progress", "--overwrite", "--log", log],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (old / "tensorboard" / "events.out.tfevents.1").read_text() == "old run"
    assert (old / "wandb_run_id").read_text() == "abc123"
    # (and not the lock file this start made there)
    assert sorted(p.name for p in old.iterdir()) == ["tensorboard", "wandb_run_id"]


def test_the_resume_hint_gives_the_log_interval_as_given():
    """Written with ``:g``, 0.1234567 came back as 0.123457."""
    import argparse

    from rollout.ppo._cli import _resume_hint

    args = argparse.Namespace(
        out="run", log="tensorboard", log_interval=0.1234567, checkpoint_every=10
    )
    hint = _resume_hint(args)
    assert hint.endswith("--log tensorboard --log-interval 0.1234567"), hint
