"""Ensembles across processes: the local launcher, and 2 processes x 2 CPU devices vs 1 x 4.

The multi-process tests start fresh Python processes with an explicit environment: they must not
inherit this pytest process's 8 simulated devices (conftest) or any JAX_/XLA_ settings.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_env import clean_env

from ensemble import _distributed as distributed
from ensemble import build, make_mesh, member_sharding
from ensemble import launch as launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "_dist_worker.py")
# Subprocess budgets: generous for 2 busy cores, yet far below "hangs forever".
RUN_TIMEOUT = 150


def run_launcher(args: list[str], timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ensemble.launch", *args]
    return subprocess.run(
        cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout
    )


def is_loopback(address: str) -> bool:
    return address.rsplit(":", 1)[0] in ("127.0.0.1", "::1")


# -------------------------------------------------------------------- launcher (no JAX inside)


def _launch_quiet(command: list[str], n: int, **kw) -> tuple[int, str, str]:
    out, err = io.BytesIO(), io.BytesIO()
    code = launcher.launch(command, n, env=clean_env(), stdout=out, stderr=err, **kw)
    return code, out.getvalue().decode(), err.getvalue().decode()


@pytest.mark.timeout(60)
def test_launcher_sets_loopback_env_and_prefixes_output():
    script = (
        "import os, sys; e = os.environ; "
        "print(e['ENSEMBLE_PROCESS_ID'], e['ENSEMBLE_NUM_PROCESSES'], "
        "e['JAX_COORDINATOR_ADDRESS'], "
        "e['JAX_COORDINATOR_BIND_ADDRESS'], e['JAX_NUM_CPU_DEVICES'], "
        "e['JAX_CPU_COLLECTIVES_IMPLEMENTATION']); print('to stderr', file=sys.stderr)"
    )
    code, out, err = _launch_quiet([sys.executable, "-c", script], 3, devices_per_process=2)
    assert code == 0, err
    lines = sorted(out.splitlines())
    assert [line.split()[:2] for line in lines] == [["[rank", f"{r}]"] for r in range(3)]
    fields = [line.split()[2:] for line in lines]
    assert [f[0] for f in fields] == ["0", "1", "2"]
    addresses = {f[2] for f in fields} | {f[3] for f in fields}
    assert len(addresses) == 1 and addresses.pop().startswith("127.0.0.1:")
    assert all(f[1] == "3" and f[4] == "2" and f[5] == "gloo" for f in fields)
    assert sorted(err.splitlines()) == [f"[rank {r}] to stderr" for r in range(3)]


@pytest.mark.timeout(120)
def test_settings_that_differ_compares_every_element_of_large_arrays():
    """Arrays went through str(), which leaves the middle of one over 1,000 elements out: two
    processes whose weights differed at element 1,000 were told they agree."""
    script = (
        "import os, numpy as np, jax.numpy as jnp\n"
        "from ensemble import distributed\n"
        "distributed.initialize()\n"
        "w = np.zeros(2000)\n"
        "if os.environ['ENSEMBLE_PROCESS_ID'] == '1': w[1000] = 1.0\n"
        "same = {'lr': 3e-4, 'table': np.arange(5000), 'keys': jnp.arange(3000)}\n"
        "print(distributed.settings_that_differ({'w': w, 'v': [w[:5]], **same}))\n"
    )
    code, out, err = _launch_quiet([sys.executable, "-c", script], 2, devices_per_process=1)
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[rank 0] ['w']", "[rank 1] ['w']"], out + err


@pytest.mark.timeout(120)
def test_processes_that_refuse_together_leave_together():
    """Process 0 exited on its refusal at once and took the coordinator with it: process 1,
    still printing its own, aborted in gRPC (134; seen once in CI, every time when it lingers)."""
    script = (
        "import os, time\n"
        "from ensemble import _distributed as distributed, _exit\n"
        "distributed.initialize()\n"
        "assert distributed.settings_that_differ({'seed': os.environ['ENSEMBLE_PROCESS_ID']})\n"
        "distributed.leave_together()\n"
        "if os.environ['ENSEMBLE_PROCESS_ID'] == '1':\n"
        "    time.sleep(3)\n"
        "print('refused', flush=True)\n"
        "_exit.exit_process(2)\n"
    )
    code, out, err = _launch_quiet([sys.executable, "-c", script], 2, devices_per_process=1)
    assert code == 2, err[-3000:]
    assert sorted(out.splitlines()) == ["[rank 0] refused", "[rank 1] refused"], out + err


@pytest.mark.timeout(120)
def test_member_batches_of_other_shapes_on_two_processes_are_refused_on_both():
    """Process 0 passed 16 rows per member and process 1 12: each built a global array of its
    own shape, and the next gather aborted a process in gloo (or a step ran on them)."""
    # Printed to stderr: Gloo's C++ writes its notes to stdout unsynchronised with Python, even
    # in the middle of a line ("[rank 0] [Gloo] Rank (4, 16, 3)" failed a run).
    script = (
        "import os, sys, numpy as np\n"
        "from ensemble import distributed, make_mesh\n"
        "say = lambda *a: print(*a, file=sys.stderr, flush=True)\n"
        "distributed.initialize()\n"
        "mesh = make_mesh(4)\n"
        "rows = 12 if os.environ['ENSEMBLE_PROCESS_ID'] == '1' else 16\n"
        "ok = distributed.member_batch_from_local(np.ones((2, 16, 3)), mesh, 4)\n"
        "say(ok.shape)\n"
        "try:\n"
        "    distributed.member_batch_from_local({'x': np.ones((2, rows, 3))}, mesh, 4)\n"
        "except ValueError as e:\n"
        "    say('refused:', e)\n"
    )
    code, out, err = _launch_quiet([sys.executable, "-c", script], 2, devices_per_process=2)
    assert code == 0, err
    lines = sorted(line for line in err.splitlines() if re.match(r"\[rank \d\] (\(|refused)", line))
    assert "[rank 0] (4, 16, 3)" in err and "[rank 1] (4, 16, 3)" in err, out + err
    refused = [line for line in lines if "refused" in line]
    assert len(refused) == 2, out + err
    assert refused[0].startswith(
        "[rank 0] refused: member_batch_from_local: process 0's leaves (per member: ['x'] "
        "(16, 3) float64) differ in shape or dtype from those of process(es) [1]; every process"
    )
    assert refused[1].startswith("[rank 1] refused: member_batch_from_local: process 1's"), err


@pytest.mark.timeout(60)
def test_launcher_stops_the_others_when_one_fails():
    script = (
        "import os, sys, time\n"
        "if os.environ['ENSEMBLE_PROCESS_ID'] == '1': time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    start = time.monotonic()
    code, _, err = _launch_quiet([sys.executable, "-c", script], 3, grace=5)
    assert code == 3
    assert time.monotonic() - start < 30
    assert "rank 1 exited with code 3" in err and "stopping the other processes [0, 2]" in err


@pytest.mark.timeout(60)
def test_launcher_reports_a_killed_process():
    script = (
        "import os, signal, time\n"
        "if os.environ['ENSEMBLE_PROCESS_ID'] == '0': os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(600)\n"
    )
    code, _, err = _launch_quiet([sys.executable, "-c", script], 2, grace=2)
    assert code == 128 + signal.SIGKILL
    assert "rank 0 was killed by SIGKILL; stopping the other processes [1]" in err


@pytest.mark.timeout(60)
def test_launcher_timeout_stops_everything():
    start = time.monotonic()
    code, _, err = _launch_quiet(
        [sys.executable, "-c", "import time; time.sleep(600)"], 2, timeout=1.0, grace=2
    )
    assert code == 124 and "--timeout" in err
    assert time.monotonic() - start < 30


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launcher_forwards_signals_and_leaves_no_process(tmp_path, sig):
    pids = tmp_path / "pids"
    # Like a process of a JAX distributed run, whose preemption service swallows SIGTERM.
    script = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        f"open({str(pids)!r} + os.environ['ENSEMBLE_PROCESS_ID'], 'w').write(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    cmd = [sys.executable, "-m", "ensemble.launch", "-n", "2", "--signal-grace", "1", "--"]
    proc = subprocess.Popen(
        [*cmd, sys.executable, "-c", script],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        files = [tmp_path / f"pids{r}" for r in range(2)]
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < deadline, "the launched processes never started"
            time.sleep(0.1)
        children = [int(f.read_text()) for f in files]
        proc.send_signal(sig)
        # They ignored it: killed once --signal-grace passed, which the launcher says (what
        # they were writing is lost: it exited 143, as after a clean stop, without a word).
        assert proc.wait(timeout=30) == 128 + signal.SIGKILL
        err = proc.stderr.read().decode()
        assert "[launch] ranks [0, 1] still ran 1 s after the signal: killed (SIGKILL)" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _sigterm_a_launch(tmp_path: Path, script: str) -> tuple[int, str]:
    """``ensemble.launch -n 2 --grace 1`` of ``script`` (each rank writes ``up<rank>`` in
    ``tmp_path`` once ready), SIGTERM once both are: its exit code and stderr."""
    cmd = [sys.executable, "-m", "ensemble.launch", "-n", "2", "--grace", "1", "--"]
    proc = subprocess.Popen([*cmd, sys.executable, "-c", script], cwd=ROOT, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"up{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the launched processes never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, proc.stderr.read().decode()


def _after_sigterm(tmp_path: Path, then: str) -> str:
    """A rank's script: ready (``up<rank>``), it waits for SIGTERM, then runs ``then`` (which
    sees ``rank``)."""
    return (
        "import os, signal, sys, time\n"
        "rank = os.environ['ENSEMBLE_PROCESS_ID']\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda *_: got.append(1))\n"
        f"open({str(tmp_path)!r} + '/up' + rank, 'w')\n"
        "while not got: time.sleep(0.05)\n" + then
    )


@pytest.mark.timeout(90)
def test_a_forwarded_signal_gives_the_processes_time_for_their_checkpoint(tmp_path):
    """A run that takes a few seconds to stop (its step, then a checkpoint write) was SIGKILLed
    after --grace (5 s), its checkpoint lost, and the launcher exited 143 as after a clean
    stop; a forwarded signal now has --signal-grace (60 s), apart from --grace."""
    script = (
        "import os, signal, sys, time\n"
        "def stop(*_):\n"
        "    time.sleep(3)  # the step, then the checkpoint\n"
        f"    open({str(tmp_path)!r} + '/ckpt' + os.environ['ENSEMBLE_PROCESS_ID'], 'w')\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"open({str(tmp_path)!r} + '/up' + os.environ['ENSEMBLE_PROCESS_ID'], 'w')\n"
        "time.sleep(600)\n"
    )
    code, err = _sigterm_a_launch(tmp_path, script)
    assert code == 128 + signal.SIGTERM
    assert all((tmp_path / f"ckpt{r}").exists() for r in range(2))
    assert "[launch]" not in err


@pytest.mark.timeout(90)
def test_a_process_that_fails_after_a_forwarded_signal_is_named_and_its_code_returned(tmp_path):
    """Every failure was ignored once a signal had come: a checkpoint write that failed on
    one rank ended the run with 143, as a clean stop, without a word."""
    script = _after_sigterm(
        tmp_path,
        "if rank == '1': sys.exit(1)  # its checkpoint write failed\n"
        "time.sleep(1); sys.exit(143)\n",
    )
    code, err = _sigterm_a_launch(tmp_path, script)
    assert code == 1
    assert "[launch] exit code 1: rank 1 failed first" in err


@pytest.mark.timeout(90)
def test_a_process_that_aborts_on_its_peers_clean_stop_is_not_blamed(tmp_path):
    """Rank 0 stops cleanly (143); rank 1, in a collective, loses its coordinator and JAX
    aborts it (134, 'another task died'): the run was stopped, not failed."""
    script = _after_sigterm(
        tmp_path,
        "if rank == '0': sys.exit(143)\n"
        "time.sleep(0.5)\n"
        "print('Terminating process because ... another task died', file=sys.stderr, flush=True)\n"
        "os.abort()\n",
    )
    code, err = _sigterm_a_launch(tmp_path, script)
    assert code == 128 + signal.SIGTERM
    assert "[launch]" not in err


def test_a_signal_while_the_launcher_starts_its_processes_is_forwarded_not_fatal():
    """The launcher takes SIGINT / SIGTERM before its first process starts (one that came
    between the start and the handlers ended it with -15), and starts none after one."""
    run = launcher._Run(io.BytesIO(), io.BytesIO(), grace=1.0, signal_grace=1.0)
    with run.forwarding_signals():
        os.kill(os.getpid(), signal.SIGTERM)  # handled here, in the main thread
        run.start([sys.executable, "-c", "import time; time.sleep(60)"], 2, 0, None, None)
        assert run.procs == [] and run.received == [signal.SIGTERM]
        assert run.supervise(timeout=30) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is not run.forward  # the old handler is back


def test_launcher_cli_needs_a_command(capsys):
    with pytest.raises(SystemExit):
        launcher.main(["-n", "2"])
    capsys.readouterr()
    assert launcher.main(["-n", "2", "--", "no_such_program_xyz"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "error: cannot run 'no_such_program_xyz': no such program (No such file or directory)"
    )


# -------------------------------------------------------------------- helpers, in this process


def test_single_process_helpers(tmp_path):
    import ensemble

    assert ensemble.distributed.initialize is distributed.initialize  # after `import ensemble`
    n = jax.device_count()
    mesh = make_mesh(n)
    info = distributed.initialize()  # backend already up, nothing asked: just reports
    assert (info.process_id, info.num_processes, info.device_count) == (0, 1, n)
    assert distributed.is_main_process()
    assert distributed.process_local_members(mesh, n) == list(range(n))
    assert distributed.process_local_members(make_mesh(2 * n), 2 * n) == list(range(2 * n))

    local = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    x = distributed.member_batch_from_local({"x": local}, mesh, n)["x"]
    assert x.shape == (n, 3) and len({s.device for s in x.addressable_shards}) == n
    np.testing.assert_array_equal(distributed.gather_metrics_to_host(x), local)
    with pytest.raises(ValueError, match="leading axis of 8"):
        distributed.member_batch_from_local(np.zeros((3, 2)), mesh, n)

    path = distributed.save_checkpoint(tmp_path / "ckpt", {"x": x})
    back = distributed.restore_checkpoint(path, {"x": x})["x"]
    assert back.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(back), local)

    # A like of another n: one line, not orbax's advice to pad or truncate (members made up or
    # silently dropped). Donated arrays: one line before orbax starts (it left a temp folder).
    fewer = distributed.member_batch_from_local({"x": local[:4]}, make_mesh(4), 4)
    with pytest.raises(ValueError, match=r"the checkpoint holds 8 members and like 4"):
        distributed.restore_checkpoint(path, fewer)
    # The same for an NNX ensemble's state (its paths are keyed otherwise in the checkpoint).
    from flax import nnx

    make = lambda rngs: nnx.Linear(3, 2, rngs=rngs)
    nnx_path = distributed.save_checkpoint(tmp_path / "n", nnx.state(build(make, n)))
    with pytest.raises(ValueError, match=r"the checkpoint holds 8 members and like 4"):
        distributed.restore_checkpoint(nnx_path, nnx.state(build(make, 4)))
    # Another dtype: orbax casts silently (float32 into bfloat16 drops 16 bits of each value).
    with pytest.raises(ValueError, match=r"like\['x'\] is bfloat16, the checkpoint float32"):
        distributed.restore_checkpoint(path, {"x": x.astype(jnp.bfloat16)})
    # Typed PRNG keys are stored as their key data, and restore as keys.
    keys = {"x": x, "keys": jax.random.split(jax.random.key(0), n), "one": jax.random.key(1)}
    back = distributed.restore_checkpoint(distributed.save_checkpoint(tmp_path / "k", keys), keys)
    for name in ("keys", "one"):
        assert back[name].dtype == keys[name].dtype
        want = jax.random.key_data(keys[name])
        np.testing.assert_array_equal(jax.random.key_data(back[name]), want)
    x.delete()
    with pytest.raises(ValueError, match=r"tree\['x'\] was donated to an earlier call"):
        distributed.save_checkpoint(tmp_path / "ckpt2", {"x": x})
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "k", "n"]


@pytest.mark.timeout(120)
def test_a_damaged_sharding_record_is_skipped_and_other_damage_still_named(tmp_path, monkeypatch):
    """Orbax's ``_sharding`` record, damaged but valid JSON, made its metadata read raise a
    KeyError: read now without it (a restore into given shardings never needs it). Any other
    damage keeps its own error, naming the checkpoint (not the view read through), also where
    no view can be made (TMPDIR gone or full)."""
    n = jax.device_count()
    x = distributed.member_batch_from_local(np.arange(2.0 * n).reshape(n, 2), make_mesh(n), n)
    path = Path(distributed.save_checkpoint(tmp_path / "c", {"x": x}, metadata={"k": 1}))
    record = path / "_sharding"
    record.write_text(record.read_text().replace("sharding_type", "shaRding_type"))
    views = tmp_path / "views"
    views.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(views))
    assert distributed.checkpoint_metadata(path) == {"k": 1}
    np.testing.assert_array_equal(distributed.restore_checkpoint(path, {"x": x})["x"], x)
    (path / "_METADATA").unlink()
    (path / "_METADATA").mkdir()  # another file damaged too
    for tmp in (views, tmp_path / "gone"):
        monkeypatch.setattr("tempfile.tempdir", str(tmp))
        with pytest.raises(distributed.DamagedCheckpoint, match=rf"\(IsADirectoryError: .*{path}"):
            distributed.checkpoint_metadata(path)
    assert not list(views.iterdir())  # the views are gone


def test_metadata_json_cannot_write_is_refused_before_anything_is_written(tmp_path):
    x = jnp.ones(3)
    refused = (
        ({"step": np.int64(3)}, "is not JSON"),
        ([1], "must be a dict"),
        ({7: "x"}, "key 7 is not a string"),  # orbax refused it after deleting (force) the old
        ({"lr": [{0: 1e-3}]}, "key 0 is not a string"),  # it came back as "0"
        ({"a": {None: 1}}, "key None is not a string"),  # (None: "nothing found", once)
    )
    for metadata, said in refused:
        with pytest.raises(ValueError, match=f"save_checkpoint: metadata {said}"):
            distributed.save_checkpoint(tmp_path / "c", {"x": x}, metadata=metadata)
        assert not list(tmp_path.iterdir())  # (orbax's temporary folder was left behind)
    path = distributed.save_checkpoint(tmp_path / "c", {"x": x}, metadata={"step": 1})
    for metadata, _ in refused:
        with pytest.raises(ValueError):
            distributed.save_checkpoint(path, {"x": x + 1}, force=True, metadata=metadata)
        assert distributed.checkpoint_metadata(path) == {"step": 1}  # kept, whole


@pytest.mark.timeout(120)
def test_a_save_over_a_checkpoint_killed_midway_keeps_the_old_one(tmp_path):
    """force=True let orbax delete the old checkpoint before writing the new one: a save
    killed meanwhile left only a temporary folder, and the only checkpoint was gone."""
    path = str(tmp_path / "c")
    distributed.save_checkpoint(path, {"w": jnp.ones(4)}, metadata={"step": 1})
    script = (
        "import os, jax.numpy as jnp\n"
        "from ensemble import _distributed as d\n"
        "real = d._swap_in\n"
        "def killed(new, path):\n"  # the new checkpoint is whole beside the old: killed here
        "    os.kill(os.getpid(), 9)\n"
        "d._swap_in = killed\n"
        f"d.save_checkpoint({path!r}, {{'w': jnp.full(4, 2.0)}}, force=True,\n"
        "                  metadata={'step': 2})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=clean_env(PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-2000:]
    back = distributed.restore_checkpoint(path, {"w": jnp.zeros(4)})
    assert back["w"].tolist() == [1.0] * 4 and distributed.checkpoint_metadata(path) == {"step": 1}
    distributed.save_checkpoint(path, {"w": jnp.full(4, 3.0)}, force=True, metadata={"step": 3})
    assert distributed.restore_checkpoint(path, {"w": jnp.zeros(4)})["w"].tolist() == [3.0] * 4
    assert sorted(os.listdir(tmp_path)) == ["c"]  # the stale new one replaced, nothing left
    # Killed between the two renames: the old one is whole under another name, and said so.
    os.rename(path, path + ".replaced")
    with pytest.raises(FileNotFoundError, match=r"holds the checkpoint it replaced: .* Rename"):
        distributed.restore_checkpoint(path, {"w": jnp.zeros(4)})
    with pytest.raises(FileNotFoundError, match=r"stopped between its two renames"):
        distributed.checkpoint_metadata(path)


def test_a_missing_or_damaged_metadata_file_is_said_not_read_as_none_given(tmp_path):
    """Orbax only logged it, and checkpoint_metadata returned {}, the answer for a checkpoint
    saved without metadata: a script reading meta.get("step", 0) resumed at step 0."""
    path = distributed.save_checkpoint(tmp_path / "c", {"w": jnp.ones(2)}, metadata={"step": 5})
    meta = os.path.join(path, "_CHECKPOINT_METADATA")
    with open(meta) as f:
        good = f.read()
    for damage in ("", good[: len(good) // 2], "[]", None):
        if damage is None:
            os.remove(meta)
        else:
            with open(meta, "w") as f:
                f.write(damage)
        with pytest.raises(ValueError, match=r"_CHECKPOINT_METADATA is missing or damaged"):
            distributed.checkpoint_metadata(path)
    none_given = distributed.save_checkpoint(tmp_path / "d", {"w": jnp.ones(2)})
    assert distributed.checkpoint_metadata(none_given) == {}
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):  # a mistyped path: {}
        distributed.checkpoint_metadata(tmp_path / "typo")


def _damaged_copies_refused(tmp_path, path, tree, w):
    """Restores copies of the checkpoint at ``path``, each with one data file's middle bytes
    flipped, whole and in part: what is read must be the saved tree. Returns how many restores
    were refused as damaged."""
    import shutil

    data = sorted(Path(path).glob("ocdbt.process_*/d/*"), key=lambda f: -f.stat().st_size)
    refused = 0
    for i in range(len(data)):
        copy = tmp_path / f"damaged{i}"
        shutil.copytree(path, copy)
        damaged = copy / data[i].relative_to(path)
        raw = bytearray(damaged.read_bytes())
        for j in range(len(raw) // 2, min(len(raw), len(raw) // 2 + 8)):
            raw[j] ^= 0xFF
        damaged.write_bytes(bytes(raw))
        for partial in (False, True):
            like = {"w": w, "a": {"b": w}} if partial else tree
            try:
                back = distributed.restore_checkpoint(copy, like, partial=partial)
            except distributed.DamagedCheckpoint as e:
                assert str(e).endswith("the checkpoint's files are damaged. Restore an earlier "
                                       "checkpoint."), e  # fmt: skip
                refused += 1
                continue
            np.testing.assert_array_equal(back["w"], w)  # what was read is the saved tree
            np.testing.assert_array_equal(back["a"]["b"], w + 1)
    return refused


def test_a_damaged_data_file_is_an_error_not_other_numbers(tmp_path):
    """Orbax keeps no checksum of the data: a data file with a few bytes flipped was read back
    as other numbers (4 to 54 of 16,000 values, no error)."""
    import flax.struct
    from flax import nnx

    n = jax.device_count()
    mesh = make_mesh(n)
    w = distributed.member_batch_from_local(
        np.arange(2000.0 * n, dtype=np.float32).reshape(n, 2000), mesh, n
    )
    tree = {"w": w, "flag": jnp.array([True, False]), "half": jnp.arange(5, dtype=jnp.bfloat16)}
    tree["key"], tree["z"] = jax.random.split(jax.random.key(0), 3), jnp.ones(2, jnp.complex64)
    tree["a"], tree["a/b"] = {"b": w + 1}, jnp.ones(3)  # names that "/".join made one
    explicit = jax.make_mesh((n,), ("m",), axis_types=(jax.sharding.AxisType.Explicit,))
    tree["e"] = jax.device_put(jnp.ones((n, 3)), jax.NamedSharding(explicit, jax.P("m")))
    path = distributed.save_checkpoint(tmp_path / "c", tree, metadata={"step": 5})
    assert distributed.checkpoint_metadata(path) == {"step": 5}  # the checksums kept apart
    small = make_mesh(n // 2, devices=jax.devices()[: n // 2])
    half = jax.ShapeDtypeStruct((n, 2000), np.float32, sharding=member_sharding(small, 2))
    resharded = distributed.restore_checkpoint(path, {**tree, "w": half})  # no false alarm
    np.testing.assert_array_equal(resharded["w"], w)
    assert _damaged_copies_refused(tmp_path, path, tree, w) >= 2  # the largest holds w
    with pytest.raises(ValueError, match="the one the checkpoint keeps its checksums under"):
        distributed.save_checkpoint(tmp_path / "d", tree, metadata={"_ensemble_checksums": 1})
    with pytest.raises(ValueError, match=r"tree\['x'\] has shape \(0, 3\), no values, and "):
        distributed.save_checkpoint(tmp_path / "e", {"x": jnp.zeros((0, 3)), "w": w})
    # Leaves orbax refuses once its write has begun (its folder then left, a later save there
    # failing): refused first, and the next save there is whole.
    unsavable = [(1 + 2j, "a complex"), ("a", "a str"), (np.array(["a"]), "of dtype <U1")]
    unsavable += [(jnp.ones(2, jnp.uint4), "of dtype uint4"), (2**70, "of dtype object")]
    for bad, what in unsavable:
        with pytest.raises(ValueError, match=rf"tree\['x'\] is {what}, which orbax cannot save"):
            distributed.save_checkpoint(tmp_path / "e", {"x": bad, "w": w})
    with pytest.raises(ValueError, match=r"the tree is \{\}, which orbax cannot save"):
        distributed.save_checkpoint(tmp_path / "e", {})
    for bare, what in ((w, "array"), (3, "value")):  # orbax's own line named classes of its own
        with pytest.raises(ValueError, match=rf"the tree is a single {what}, .* wrap it, e\.g\."):
            distributed.save_checkpoint(tmp_path / "e", bare)
    with pytest.raises(ValueError, match=r"the tree is State\(\{\}\), which orbax cannot save"):
        distributed.save_checkpoint(tmp_path / "e", nnx.State({}))

    @flax.struct.dataclass
    class Static:
        k: int = flax.struct.field(pytree_node=False)

    saved = distributed.save_checkpoint(tmp_path / "s", Static(1))  # no leaves: orbax saves it
    assert distributed.restore_checkpoint(saved, Static(1)) == Static(1)
    assert not list(tmp_path.glob("e*"))
    back = distributed.restore_checkpoint(distributed.save_checkpoint(tmp_path / "e", tree), tree)
    np.testing.assert_array_equal(back["w"], w)


def test_damaged_checksums_or_metadata_are_refused_not_taken_for_none_kept(tmp_path):
    """The checks were skipped where the checksums could not be read (a metadata file that is
    no JSON), and a record that was no dict was an AttributeError."""
    path = Path(distributed.save_checkpoint(tmp_path / "c", {"w": jnp.ones(2)}))
    meta = path / "_CHECKPOINT_METADATA"
    good = json.loads(meta.read_text())
    for record in ([1, 2], "x", 5):
        meta.write_text(json.dumps({**good, "custom_metadata": {"_ensemble_checksums": record}}))
        with pytest.raises(distributed.DamagedCheckpoint, match="its checksum record is damaged"):
            distributed.restore_checkpoint(path, {"w": jnp.zeros(2)})
    meta.write_bytes(b"\xff" + json.dumps(good).encode())
    with pytest.raises(distributed.DamagedCheckpoint, match="_CHECKPOINT_METADATA is missing or"):
        distributed.restore_checkpoint(path, {"w": jnp.zeros(2)})


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_files_orbax_reads_are_one_line_naming_the_checkpoint(tmp_path):
    """A key renamed by a flipped bit in orbax's JSON files gave a bare KeyError (or orbax's
    "unknown key"), and a data file's first byte flipped a 61-line TensorStore spec."""
    n = jax.device_count()
    rows = np.random.default_rng(0).standard_normal((n, 2000)).astype(np.float32)
    w = distributed.member_batch_from_local(rows, make_mesh(n), n)
    saved = Path(distributed.save_checkpoint(tmp_path / "c", {"w": w}, metadata={"step": 3}))
    data = max(saved.glob("ocdbt.process_*/d/*"), key=lambda f: f.stat().st_size)
    damages = [
        ("_CHECKPOINT_METADATA", b'"metrics"', b'"metri9s"'),
        ("_METADATA", b'"key_metadata"', b'"key_metadatb"'),
        (str(data.relative_to(saved)), None, None),
    ]
    for i, (name, old, new) in enumerate(damages):
        copy = tmp_path / f"d{i}"
        shutil.copytree(saved, copy)
        raw = (copy / name).read_bytes()
        assert old is None or old in raw
        raw = raw.replace(old, new) if old else bytes([raw[0] ^ 0x5A]) + raw[1:]
        (copy / name).write_bytes(raw)
        for partial in (False, True):
            with pytest.raises(distributed.DamagedCheckpoint) as caught:
                distributed.restore_checkpoint(copy, {"w": w}, partial=partial)
            line = str(caught.value)
            assert "\n" not in line and len(line) < 400, line
            assert line.startswith(f"checkpoint {copy}: it cannot be read ("), line
        if old:
            with pytest.raises(distributed.DamagedCheckpoint, match="it cannot be read"):
                distributed.checkpoint_metadata(copy)


def test_a_callers_mistake_is_its_own_error_not_called_damage(tmp_path):
    """Every orbax error was taken for damage: a mistyped path, the run's folder given for
    the checkpoint, a like that does not fit, were each 'the checkpoint's files are damaged.
    Restore an earlier checkpoint'."""
    n = jax.device_count()
    w = distributed.member_batch_from_local(np.ones((n, 2), np.float32), make_mesh(n), n)
    path = distributed.save_checkpoint(tmp_path / "run" / "c", {"w": w})
    for wrong in (tmp_path / "run" / "typo", tmp_path / "run"):
        for read in (lambda p: distributed.restore_checkpoint(p, {"w": w}),
                     distributed.checkpoint_metadata):  # fmt: skip
            with pytest.raises(FileNotFoundError, match=r"no checkpoint at|holds no checkpoint"):
                read(wrong)
    three = jax.sharding.Mesh(np.array(jax.devices()[:3]), ("m",))
    uneven = jax.ShapeDtypeStruct((n, 2), np.float32, sharding=jax.NamedSharding(three, jax.P("m")))
    with pytest.raises(ValueError) as caught:  # JAX's: axis 0 is not divisible by 3
        distributed.restore_checkpoint(path, {"w": uneven})
    assert not isinstance(caught.value, distributed.DamagedCheckpoint), caught.value
    with pytest.raises(TypeError, match="Type mismatch"):  # orbax's, naming the key
        distributed.restore_checkpoint(path, {"w": {"x": w}}, partial=True)
    np.testing.assert_array_equal(distributed.restore_checkpoint(path, {"w": w})["w"], w)


def test_a_checkpoint_saved_before_checksums_were_kept_still_restores(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "old", {"w": jnp.arange(3.0)}, custom_metadata={"step": 1})
    back = distributed.restore_checkpoint(tmp_path / "old", {"w": jnp.zeros(3)})
    assert back["w"].tolist() == [0.0, 1.0, 2.0]
    assert distributed.checkpoint_metadata(tmp_path / "old") == {"step": 1}
    # NumPy and Python 64-bit values, without checksums to match: read narrowed, as JAX
    # narrows them (they were called "saved with x64 on").
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "n", {"lr": np.float64(0.1), "step": 5})
    like = {"lr": jnp.zeros(()), "step": jnp.zeros((), int)}
    back = distributed.restore_checkpoint(tmp_path / "n", like)
    assert back["lr"] == np.float32(0.1) and back["step"] == 5


def test_a_forced_save_through_a_link_replaces_the_link_and_keeps_what_it_linked(tmp_path):
    """The swap could not remove a link left at <path>.replaced: the second save failed."""
    real, link = tmp_path / "run1", tmp_path / "latest"
    distributed.save_checkpoint(real, {"w": jnp.ones(2)})
    os.symlink(real, link)
    for value in (2.0, 3.0):
        distributed.save_checkpoint(link, {"w": jnp.full(2, value)}, force=True)
        assert (
            distributed.restore_checkpoint(link, {"w": jnp.zeros(2)})["w"].tolist() == [value] * 2
        )
    assert sorted(os.listdir(tmp_path)) == ["latest", "run1"]
    assert distributed.restore_checkpoint(real, {"w": jnp.zeros(2)})["w"].tolist() == [1.0] * 2


def test_leaves_stored_under_one_name_are_refused_before_anything_is_written(tmp_path):
    """Orbax names a leaf by its keys joined with '.': tree['a.b'] and tree['a']['b'] were
    one stored leaf, restored as the same values for both (NumPy leaves: no error at all)."""
    for a, b in ((np.ones(2), np.full(2, 2.0)), (jnp.ones(2), jnp.full(2, 2.0))):
        with pytest.raises(ValueError, match=r"tree\['a'\]\['b'\] and tree\['a.b'\] would be"):
            distributed.save_checkpoint(tmp_path / "c", {"a.b": a, "a": {"b": b}})
        assert not os.listdir(tmp_path)
    # TensorStore drops a name's trailing '/': tree['a/'] was tree['a'], and {'': x, '/': y}.
    for tree in ({"a": np.ones(2), "a/": 2.0}, {"": np.ones(2), "/": np.ones(2)},
                 {"a": {"b/": np.ones(2)}, "a.b": np.ones(2)}):  # fmt: skip
        with pytest.raises(ValueError, match=r"would be stored under one name"):
            distributed.save_checkpoint(tmp_path / "c", tree)
        assert not os.listdir(tmp_path)
    path = distributed.save_checkpoint(tmp_path / "c", {"a/b": jnp.ones(2), "a": {"b": b}})
    back = distributed.restore_checkpoint(path, {"a/b": jnp.zeros(2), "a": {"b": jnp.zeros(2)}})
    assert back["a/b"].tolist() == [1.0, 1.0] and back["a"]["b"].tolist() == [2.0, 2.0]


def test_a_key_leaf_comes_back_as_the_likes_kind_typed_or_raw(tmp_path):
    """Orbax gave a key leaf back as saved (a typed key into a like of raw key data, and the
    reverse), of another shape and dtype than the like's, without a word."""
    mesh = make_mesh(8)
    for impl in ("threefry2x32", "rbg"):
        typed = jax.device_put(jax.random.split(jax.random.key(0, impl=impl), 8),
                               member_sharding(mesh, 1))  # fmt: skip
        raw = jax.random.key_data(typed)
        saved = {k: distributed.save_checkpoint(tmp_path / f"{impl}-{k}", {"k": x})
                 for k, x in (("typed", typed), ("raw", raw))}  # fmt: skip
        sds = jax.ShapeDtypeStruct(typed.shape, typed.dtype, sharding=typed.sharding)
        for path, like in ((saved["typed"], raw), (saved["raw"], typed), (saved["raw"], sds)):
            for partial in (False, True):
                got = distributed.restore_checkpoint(path, {"k": like}, partial=partial)["k"]
                assert (got.dtype, got.shape) == (like.dtype, like.shape), (path, like)
                data = jax.random.key_data(got) if got.dtype == typed.dtype else got
                np.testing.assert_array_equal(data, raw)
                assert got.sharding == like.sharding
                assert [s.data.shape[0] for s in got.addressable_shards] == [1] * 8
    # Another implementation: refused, whether its key data has the same shape or not.
    other = jax.random.split(jax.random.key(0, impl="unsafe_rbg"), 8)
    with pytest.raises(ValueError, match=r"like\['k'\] is a key<urbg> key, the checkpoint's a "
                       r"key<rbg> key \(another PRNG implementation\)"):  # fmt: skip
        distributed.restore_checkpoint(saved["typed"], {"k": other})
    one = jax.random.key(0)
    with pytest.raises(ValueError, match=r"like\['k'\] is a key<fry> key of shape \(\) \(key "
                       r"data \(2,\)\), the checkpoint's key data \(8, 4\)"):  # fmt: skip
        distributed.restore_checkpoint(saved["typed"], {"k": one})


def test_a_save_replaces_only_a_checkpoint_and_only_with_force(tmp_path):
    """force=True deleted whatever was at the path (a run folder given for its ckpt/ subfolder
    lost the user's files), and without it orbax said only 'Destination ... already exists'."""
    tree = {"w": jnp.ones(2)}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    (tmp_path / "empty").mkdir()
    for force in (False, True):
        with pytest.raises(FileExistsError, match=r"run exists and is not a checkpoint \(holds "
                           r"notes.txt\): give a directory that does not exist yet"):  # fmt: skip
            distributed.save_checkpoint(tmp_path / "run", tree, force=force)
        with pytest.raises(FileExistsError, match=r"file is a file, not a checkpoint"):
            distributed.save_checkpoint(tmp_path / "file", tree, force=force)
    assert (tmp_path / "run" / "notes.txt").read_text() == (tmp_path / "file").read_text()
    with pytest.raises(FileExistsError, match=r"not a checkpoint \(empty\).*or force=True"):
        distributed.save_checkpoint(tmp_path / "empty", tree)
    distributed.save_checkpoint(tmp_path / "empty", tree, force=True)
    with pytest.raises(FileExistsError, match=r"already holds a checkpoint: pass force=True"):
        distributed.save_checkpoint(tmp_path / "empty", {"w": jnp.zeros(2)})
    assert distributed.restore_checkpoint(tmp_path / "empty", tree)["w"].tolist() == [1.0, 1.0]
    assert sorted(os.listdir(tmp_path)) == ["empty", "file", "run"]
    # A file of the user's beside the checkpoint's own, a folder holding only a _METADATA of
    # theirs, folders of theirs named as the replacing's steps, a link to nothing: all kept.
    (tmp_path / "empty" / "eval.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds a checkpoint and eval.txt, which replacing"):
        distributed.save_checkpoint(tmp_path / "empty", tree, force=True)
    (tmp_path / "empty" / "eval.txt").unlink()
    (tmp_path / "run" / "_METADATA").write_text("{}")
    with pytest.raises(FileExistsError, match=r"holds a checkpoint and notes.txt"):
        distributed.save_checkpoint(tmp_path / "run", tree, force=True)
    for step in ("replacing", "replaced"):
        (tmp_path / f"empty.{step}").mkdir()
        (tmp_path / f"empty.{step}" / "notes.txt").write_text("mine")
        with pytest.raises(FileExistsError, match=rf"empty.{step} is in the way of replacing"):
            distributed.save_checkpoint(tmp_path / "empty", tree, force=True)
        shutil.rmtree(tmp_path / f"empty.{step}")
    os.symlink(tmp_path / "empty", tmp_path / "empty.replacing")  # orbax: 'Cannot call rmtree'
    with pytest.raises(FileExistsError, match=r"empty.replacing is in the way of replacing"):
        distributed.save_checkpoint(tmp_path / "empty", tree, force=True)
    os.unlink(tmp_path / "empty.replacing")
    os.symlink(tmp_path / "nowhere", tmp_path / "link")
    with pytest.raises(FileExistsError, match=r"link is a link to nothing, not a checkpoint"):
        distributed.save_checkpoint(tmp_path / "link", tree, force=True)
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"
    assert distributed.restore_checkpoint(tmp_path / "empty", tree)["w"].tolist() == [1.0, 1.0]


@pytest.mark.timeout(120)
def test_metadata_json_cannot_write_is_refused_on_every_process():
    """Process 0 alone writes the metadata, once the collective save has begun: its TypeError
    left process 1 waiting in the save until JAX aborted both (134, 120 s later)."""
    script = (
        "import tempfile, numpy as np, jax.numpy as jnp\n"
        "from ensemble import distributed\n"
        "distributed.initialize()\n"
        "try:\n"
        "    distributed.save_checkpoint(tempfile.mkdtemp() + '/c', {'x': jnp.ones(3)},\n"
        "                                metadata={'step': np.int64(3)})\n"
        "except ValueError as e:\n"
        "    print('refused:', str(e).split(' (')[0])\n"
    )
    code, out, err = _launch_quiet([sys.executable, "-c", script], 2, devices_per_process=1)
    assert code == 0, err[-3000:]
    said = "refused: save_checkpoint: metadata is not JSON"
    assert sorted(out.splitlines()) == [f"[rank {r}] {said}" for r in range(2)], out + err


def test_a_sharding_record_that_is_no_json_still_gives_the_leaves_metadata(tmp_path, caplog):
    """Orbax logs such damage (three "Failed to get item metadata" warnings on a resume that
    worked) and reads the metadata without the leaves', so no shape or dtype was checked:
    another member count was restored as orbax's own error, not the one line naming it."""
    import logging

    from ensemble._distributed import orbax_logs_held, stored_metadata

    n = jax.device_count()
    x = distributed.member_batch_from_local(np.arange(2.0 * n).reshape(n, 2), make_mesh(n), n)
    path = Path(distributed.save_checkpoint(tmp_path / "c", {"x": x}, metadata={"k": 1}))
    (path / "_sharding").write_text('{"x": "not json"}')
    with caplog.at_level(logging.WARNING):
        assert stored_metadata(str(path)).item_metadata["x"].shape == (n, 2)
        with orbax_logs_held(logging.WARNING):  # as a run's resume reads it: the outer block
            np.testing.assert_array_equal(distributed.restore_checkpoint(path, {"x": x})["x"], x)
    assert not [r for r in caplog.records if "item metadata" in r.getMessage()]
    small = make_mesh(n // 2, devices=jax.devices()[: n // 2])
    half = jax.ShapeDtypeStruct((n // 2, 2), x.dtype, sharding=member_sharding(small, 2))
    with pytest.raises(ValueError, match=rf"the checkpoint holds {n} members and like {n // 2};"):
        distributed.restore_checkpoint(path, {"x": half})


@pytest.mark.timeout(120)
def test_restore_takes_the_params_alone_and_refuses_unplaced_leaves_in_one_line(tmp_path):
    """Params alone for inference (``partial=True``; without it one line, not orbax's dump of
    the whole tree and a flag this function lacked); NumPy leaves: read onto the only device
    of a one-device process, refused with several (orbax read them in the saved layout, and
    failed on another device count with advice to pass the tree just passed)."""
    n = jax.device_count()
    mesh, small = make_mesh(n), make_mesh(n, devices=jax.devices()[: n // 2])
    w = distributed.member_batch_from_local(
        np.arange(2.0 * n, dtype=np.float32).reshape(n, 2), mesh, n
    )
    path = distributed.save_checkpoint(tmp_path / "c", {"params": {"w": w}, "opt": {"m": w + 1}})
    like = {
        "params": {
            "w": jax.ShapeDtypeStruct((n, 2), np.float32, sharding=member_sharding(small, 2))
        }
    }
    with pytest.raises(
        ValueError,
        match=r"like has 1 of the checkpoint's 2 leaves \(not opt/m\); pass partial=True",
    ):
        distributed.restore_checkpoint(path, like)
    back = distributed.restore_checkpoint(path, like, partial=True)
    assert list(back) == ["params"] and back["params"]["w"].sharding == member_sharding(small, 2)
    unwrapped = like["params"]  # {"w": ...} without "params": no leaf of the checkpoint
    with pytest.raises(
        ValueError,
        match=r"like\['w'\] \(of 1 such leaves\) is not in the checkpoint, which holds opt/m, p",
    ):
        distributed.restore_checkpoint(path, unwrapped, partial=True)
    np.testing.assert_array_equal(back["params"]["w"], np.asarray(w))
    host = {
        "params": {"w": np.zeros((n, 2), np.float32)},
        "opt": {"m": np.zeros((n, 2), np.float32)},
    }
    with pytest.raises(
        ValueError, match=r"like\['opt'\]\['m'\] \(of 2 such leaves\) has no placement"
    ):
        distributed.restore_checkpoint(path, host)
    with pytest.raises(ValueError, match=r"not the checkpoint's \(like has params/b\)"):
        distributed.restore_checkpoint(path, {"params": {"w": w, "b": w}, "opt": {"m": w}})
    code = (
        "import sys, numpy as np, jax\n"
        "from ensemble.distributed import restore_checkpoint\n"
        f"z = np.zeros(({n}, 2), np.float32)\n"
        "back = restore_checkpoint(sys.argv[1], {'params': {'w': z}, 'opt': {'m': z}})\n"
        "print(jax.device_count(), back['params']['w'].sum(), back['opt']['m'].sum())\n"
    )
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.run(
        [sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.stdout.split() == ["1", str(float(w.sum())), str(float((w + 1).sum()))], proc.stderr


def test_initialize_too_late_says_what_to_do():
    jnp.zeros(1).block_until_ready()  # the backend is up
    with pytest.raises(RuntimeError, match="before any JAX computation"):
        distributed.initialize("127.0.0.1:1", num_processes=2, process_id=0)


@pytest.mark.timeout(60)
def test_initialize_with_half_the_settings_says_what_is_missing():
    script = "from ensemble import _distributed as d; d.initialize()"
    env = clean_env(JAX_COORDINATOR_ADDRESS="127.0.0.1:1", ENSEMBLE_NUM_PROCESSES="2")
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=50
    )
    assert res.returncode != 0
    assert "process_id=None" in res.stderr and "ENSEMBLE_PROCESS_ID" in res.stderr


@pytest.mark.timeout(120)
def test_a_taken_coordinator_port_is_one_line_not_a_crash(tmp_path):
    # JAX 0.10.2 segfaulted process 0 (or failed to start its RPC server) and left the others
    # waiting 120 s to abort; the launcher checked its own --port, initialize did not.
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        script = f"from ensemble import distributed; distributed.initialize({address!r}, 2, 0)"
        res = subprocess.run(
            [sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert res.returncode == 1 and "OSError: the coordinator's port" in res.stderr, res.stderr
        out = tmp_path / "run"
        argv = ["--coordinator", address, "--num-processes", "2", "--process-id", "0",
                "--members", "2", "--out", str(out), "--no-progress"]  # fmt: skip
        res = subprocess.run(
            [sys.executable, "-m", "rollout.ppo", *argv], env=clean_env(), capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines()[-1].startswith("error: the coordinator's port")
    assert not out.exists()  # the run directory the check made is gone again


def test_a_process_id_that_contradicts_the_launchers_is_refused(monkeypatch):
    # Every process given --process-id 1 under the launcher: no process 0, so no coordinator,
    # and each waited 120 s to abort with a C++ stack trace.
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
    with pytest.raises(ValueError, match=r"process_id=1 contradicts \$ENSEMBLE_PROCESS_ID=0"):
        distributed.resolve_settings("127.0.0.1:1", 2, 1)
    assert distributed.resolve_settings("127.0.0.1:1", 2, 0) == ("127.0.0.1:1", 2, 0)
    # A process count of its own waited for processes that never came (it was taken silently).
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    with pytest.raises(ValueError, match=r"num_processes=4 contradicts \$ENSEMBLE_NUM_PROCESSES=2"):
        distributed.resolve_settings("127.0.0.1:1", 4, 0)
    assert distributed.resolve_settings("127.0.0.1:1", None, None) == ("127.0.0.1:1", 2, 0)


def test_a_coordinator_address_without_a_port_or_beside_a_cluster_is_one_line(monkeypatch):
    """JAX took '127.0.0.1' with a bare IndexError (the CLI printed it with exit 1), a port
    past 65535 with an OverflowError, ':1234' by aborting; and it mixed ENSEMBLE_* settings
    with a detected cluster's (3 processes with SLURM's 2)."""
    for bad in ("127.0.0.1", "127.0.0.1:99999", "127.0.0.1:abc", ":1234", "host:\u00b2"):
        with pytest.raises(ValueError, match=r"must be host:port with a port in 1\.\.65535"):
            distributed.resolve_settings(bad, 2, 0)
    assert distributed.resolve_settings("[::1]:1234", 2, 0) == ("[::1]:1234", 2, 0)
    slurm = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "localhost"}  # fmt: skip
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "3")
    with pytest.raises(ValueError, match=r"num_processes=3 disagrees with the Slurm cluster's 2"):
        distributed.resolve_settings()
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    assert distributed.resolve_settings() == (None, 2, None)  # agreeing: accepted
    # All three given (ensemble.launch -n 4 inside a SLURM job step): JAX asks SLURM nothing.
    monkeypatch.delenv(distributed.ENV_NUM_PROCESSES)
    assert distributed.resolve_settings("127.0.0.1:1234", 4, 3) == ("127.0.0.1:1234", 4, 3)


def test_loopback_detection():
    assert distributed._is_loopback("127.0.0.1:1234") and distributed._is_loopback("[::1]:1")
    assert distributed._is_loopback("localhost:80")
    assert not distributed._is_loopback("10.0.0.1:1234")


# -------------------------------------------------------------------- 2 processes x 2 devices


def _run_on_one_and_two_processes(one, two) -> subprocess.CompletedProcess:
    """The worker on 1 process x 4 devices and under the launcher on 2 x 2, both at once."""
    ref = subprocess.Popen(
        [sys.executable, WORKER, "--out", str(one)],
        cwd=ROOT,
        env=clean_env(JAX_NUM_CPU_DEVICES="4"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        res = run_launcher(
            ["-n", "2", "--devices-per-process", "2", "--timeout", "140", "--",
             sys.executable, WORKER, "--out", str(two)]
        )  # fmt: skip
        ref_out, ref_err = ref.communicate(timeout=RUN_TIMEOUT)
    finally:
        if ref.poll() is None:
            ref.kill()
            ref.wait()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert ref.returncode == 0, ref_out[-3000:] + ref_err[-3000:]
    return res


def _check_process_report(r: int, rep: dict, single: dict) -> None:
    """Process r of 2 holds its own members' shards only, and trained as the 1-process run."""
    assert rep["num_processes"] == 2 and rep["device_count"] == 4
    assert len(rep["local_devices"]) == 2
    assert rep["local_members"] == [2 * r, 2 * r + 1]
    assert not any(rep["fully_addressable"])
    for leaf, shards in rep["shards"].items():
        assert sorted(s[0] for s in shards) == sorted(rep["local_devices"]), leaf
        assert sorted((s[1], s[2]) for s in shards) == [(2 * r, 2 * r + 1), (2 * r + 1, 2 * r + 2)]
        assert all(s[3][0] == 1 for s in shards), leaf
    for leaf, shards in rep["nnx_shards"].items():  # the NNX ensemble: the same placement
        assert [s[1:] for s in shards] == [[2 * r, 2 * r + 1], [2 * r + 1, 2 * r + 2]], leaf
        assert sorted(s[0] for s in shards) == sorted(rep["local_devices"]), leaf
    # n = 2: one member per process (over its 2 devices); n = 8: four per process.
    assert rep["other_layout_members"] == {"2": [r], "8": list(range(4 * r, 4 * r + 4))}
    assert rep["donated"] and rep["checkpoint_roundtrip"]
    np.testing.assert_allclose(rep["losses"], single["losses"], rtol=1e-5)
    # The memory report: each device holds one member, as in the 1-process run.
    assert set(rep["memory"]["live"].values()) == set(single["memory"]["live"].values())
    assert rep["memory"]["compiled_peak"] == single["memory"]["compiled_peak"]
    rows = [line.split()[0] for line in rep["memory"]["table"].splitlines()]
    assert sorted(r for r in rows if r.startswith("cpu:")) == [  # its own devices only
        f"cpu:{d}" for d in sorted(rep["local_devices"])
    ]
    # Nothing listens beyond loopback (coordinator on rank 0, gloo on both).
    if sys.platform.startswith("linux"):  # read off /proc/net/tcp*
        assert rep["listening"], "found no listening socket to check"
    assert all(is_loopback(a) for a in rep["listening"]), rep["listening"]


def _check_restores_on_four_local_devices(ckpt, saved) -> None:
    """The 2 processes' checkpoint restores on another topology: 4 of this process's devices."""
    mesh = make_mesh(4, devices=jax.devices()[:4])
    like = {
        "Dense_0": {"kernel": (4, 3, 32), "bias": (4, 32)},
        "Dense_1": {"kernel": (4, 32, 1), "bias": (4, 1)},
    }
    like = jax.tree_util.tree_map(
        lambda shape: jax.ShapeDtypeStruct(
            shape, np.float32, sharding=member_sharding(mesh, len(shape))
        ),
        like,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    restored = distributed.restore_checkpoint(ckpt, like)
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored):
        key = jax.tree_util.keystr(path)
        assert leaf.sharding == member_sharding(mesh, leaf.ndim), key
        np.testing.assert_array_equal(np.asarray(leaf), saved[key], err_msg=key)


@pytest.mark.timeout(300)
def test_two_processes_train_like_one(tmp_path):
    """4 members on 2 processes x 2 CPU devices == the same 4 members on 1 process x 4 devices.

    Linen and NNX, and the other layouts too (n = 2: a member spans 2 devices; n = 8: 2 members
    per device).
    """
    two, one = tmp_path / "two", tmp_path / "one"
    res = _run_on_one_and_two_processes(one, two)  # they share nothing but the seeds

    # Same seeds, same data: the same parameters (per-member math is the same program).
    a, b = np.load(two / "params.npz"), np.load(one / "params.npz")
    assert sorted(a) == sorted(b)
    assert {k[:3] for k in a} >= {"nnx", "n2[", "n8["}, sorted(a)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)

    single = json.loads((one / "report_0.json").read_text())
    assert single["num_processes"] == 1
    for r in range(2):
        _check_process_report(r, json.loads((two / f"report_{r}.json").read_text()), single)
    assert "[rank 0] done" in res.stdout
    _check_restores_on_four_local_devices(two / "ckpt", a)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how, code", [("raise", 1), ("exit", 3)])
def test_failing_process_stops_the_run_under_the_launcher(tmp_path, how, code):
    """Rank 1 raises (or ends with an exit code, as a command line that caught its error)
    mid-run while rank 0 waits for it in a collective: all over, fast. (An exit code used to
    wait at JAX's shutdown barrier, then end the run with 134.)"""
    res = run_launcher(
        ["-n", "2", "--devices-per-process", "2", "--grace", "2", "--timeout", "140", "--",
         sys.executable, WORKER, "--out", str(tmp_path), "--forever", "--die-rank", "1",
         "--die-how", how]
    )  # fmt: skip
    ended = time.time()
    assert res.returncode == code, res.stderr[-3000:]
    if how == "raise":
        assert "RuntimeError: rank 1 fails on purpose" in res.stderr
    # Rank 0's collective fails on the closed connection as soon as rank 1 is gone, so rank 0
    # may end on its own before the launcher stops it; either way rank 1 is named first.
    assert f"rank 1 failed first (exited with code {code})" in res.stderr, res.stderr[-3000:]
    assert (
        f"rank 1 exited with code {code}; stopping the other processes [0]" in res.stderr
        or f"rank 1 exited with code {code}; the other processes had ended too." in res.stderr
    ), res.stderr[-3000:]
    died = float(res.stdout.split("rank 1 dying now at ")[1].split()[0])
    print(f"launcher exited {ended - died:.1f} s after rank 1 raised")
    # Well below the worker's 30 s shutdown timeout: the failing process did not wait at the
    # shutdown barrier (ensemble.distributed exits at once on an uncaught exception).
    assert ended - died < 25


@pytest.mark.timeout(200)
def test_dead_peer_is_detected_without_the_launcher(tmp_path):
    """As on two hosts (no launcher to stop the survivor): the heartbeat timeout ends it.

    The survivor is idle (not in a collective, which would fail at once on the closed
    connection), so this is JAX's heartbeat check alone.
    """
    port = launcher.free_port()
    procs = []
    for rank in range(2):
        env = launcher.process_env(rank, 2, port, devices_per_process=2, base=clean_env())
        cmd = [sys.executable, WORKER, "--out", str(tmp_path), "--forever", "--die-rank", "1",
               "--idle-rank", "0", "--heartbeat", "5"]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        out1, _ = procs[1].communicate(timeout=RUN_TIMEOUT)
        died = float(out1.split("rank 1 dying now at ")[1].split()[0])
        _, err0 = procs[0].communicate(timeout=60)
        ended = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode != 0
    print(f"survivor exited {ended - died:.1f} s after its peer died (heartbeat timeout 5 s)")
    assert ended - died < 60, f"survivor took {ended - died:.1f} s"
    assert "another task died" in err0, err0[-3000:]


@pytest.mark.timeout(200)
def test_cli_devices_beyond_what_the_launcher_gave_each_process_is_one_line(tmp_path):
    res = run_launcher(
        ["-n", "2", "--devices-per-process", "1", "--grace", "2", "--",
         sys.executable, "-m", "rollout.ppo", "--members", "2", "--devices", "2",
         "--out", str(tmp_path / "run"), "--no-progress"]
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert "--devices 2: each process has only 1 CPU devices" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.timeout(120)
def test_a_process_waiting_for_its_coordinator_says_so(tmp_path):
    """JAX waits for the other processes in silence (and aborts after its timeout): the CLI
    first says which coordinator it waits for."""
    port = launcher.free_port()  # nobody listens there
    cmd = [sys.executable, "-m", "rollout.ppo", "--members", "2", "--num-processes", "2",
           "--process-id", "1", "--coordinator", f"127.0.0.1:{port}", "--out",
           str(tmp_path / "run"), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline, seen = time.monotonic() + 90, []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            seen.append(line)
            if "joining the run" in line or not line:
                break
        assert (
            f"process 1 of 2: joining the run through the coordinator at 127.0.0.1:{port}"
            in (seen[-1])
        ), seen
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "differs, args, message",
    [
        ("total_steps", "--total-steps $((256 * (ENSEMBLE_PROCESS_ID + 1)))",
         "different arguments (--total-steps)"),
        # The CLI makes a process's CPU devices from --members: unequal device counts, which
        # JAX's allgather cannot even take (a bare reshape error).
        ("members", "--members $((4 + 2 * ENSEMBLE_PROCESS_ID)) --total-steps 256",
         "different arguments (--members)"),
        ("out", "--total-steps 256 --out-suffix", "different arguments (--out)"),
        # Not in the config: one process saved while the other trained, both waiting forever.
        ("checkpoint_every", "--total-steps 1024 --checkpoint-every $((1 + ENSEMBLE_PROCESS_ID))",
         "different arguments (--checkpoint-every)"),
        # Other devices on one process: a gloo timeout after 45 s, a run.json left behind.
        ("devices", "--total-steps 256 --devices $((2 - ENSEMBLE_PROCESS_ID))",
         "different arguments (--devices)"),
        # x64 on one process: its members trained in float64, the others' in float32 (rc 0).
        ("x64", "--total-steps 256 --x64-on-1",
         "different settings (these differ between them: jax_enable_x64)"),
    ],
)  # fmt: skip
def test_processes_started_with_different_settings_are_refused_not_left_waiting(
    tmp_path, differs, args, message
):
    """A --total-steps of its own on one process: both waited forever in collectives that did
    not match (deaf to SIGTERM); a --lr of its own trained those members on settings run.json
    does not record; an --out process 1 could not see was a bare FileNotFoundError."""
    out = shlex.quote(str(tmp_path / "run"))
    if args.endswith("--out-suffix"):
        args, out = args.removesuffix(" --out-suffix"), out + "_$ENSEMBLE_PROCESS_ID"
    x64 = args.endswith("--x64-on-1")
    args = args.removesuffix(" --x64-on-1")
    members = "" if "--members" in args else "--members 2 "
    ppo = (f"exec {shlex.quote(sys.executable)} -m rollout.ppo {members}--num-envs 2 "
           f"--num-steps 64 --no-progress --out {out} {args}")  # fmt: skip
    if x64:
        ppo = '[ "$ENSEMBLE_PROCESS_ID" = 1 ] && export JAX_ENABLE_X64=1; ' + ppo
    cmd = [sys.executable, "-m", "ensemble.launch", "-n", "2", "--", "bash", "-c", ppo]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr, proc.stderr[-3000:]
    assert not list(tmp_path.iterdir())  # nothing left behind (no --out made, no run.json)


@pytest.mark.timeout(240)
def test_a_flag_given_on_one_process_only_with_the_value_it_takes_anyway_is_accepted(tmp_path):
    """``--seed 0`` on one process and no --seed on the other (whose seed is then 0): the
    processes were refused as started with different arguments."""
    seed = '$([ "$ENSEMBLE_PROCESS_ID" = 0 ] && echo --seed 0)'
    out = shlex.quote(str(tmp_path / "run"))
    ppo = (f"exec {shlex.quote(sys.executable)} -m rollout.ppo --members 2 --num-envs 2 "
           f"--num-steps 64 --total-steps 256 --no-progress --out {out} {seed}")  # fmt: skip
    cmd = [sys.executable, "-m", "ensemble.launch", "-n", "2", "--", "bash", "-c", ppo]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["config"]["seed"] == 0


@pytest.mark.timeout(200)
def test_every_process_started_by_hand_says_which_arguments_differ(tmp_path):
    """As on real hosts (no launcher to show rank 0's line): process 0, which holds the
    coordinator, stopped as soon as it saw the difference, and process 1 then aborted in gRPC
    errors (134), or blamed process 0 for never reporting. The coordinator's address may be
    another name for the same one (127.0.0.1 on its own host)."""
    port = launcher.free_port()
    procs = []
    for rank, host in enumerate(["127.0.0.1", "localhost"]):
        cmd = [sys.executable, "-m", "rollout.ppo", "--members", "2", "--devices", "1",
               "--total-steps", "256", "--num-envs", "2", "--num-steps", "64", "--no-progress",
               "--out", str(tmp_path / "run"), "--coordinator", f"{host}:{port}",
               "--num-processes", "2", "--process-id", str(rank),
               "--checkpoint-every", str(1 + rank)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stderr=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, text=True))  # fmt: skip
    try:
        errs = [p.communicate(timeout=150)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    said = "error: the processes of this run were started with different arguments "
    for p, err in zip(procs, errs):
        assert p.returncode == 2, err[-3000:]
        assert said + "(--checkpoint-every); start every process" in err, err[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(200)
def test_train_in_two_processes_refuses_a_checkpoint_every_of_its_own(tmp_path):
    """train()'s own comparison held the config only: one process saving while the other
    trained would wait forever in collectives that do not match."""
    script = tmp_path / "two.py"
    script.write_text(
        "import os, sys\n"
        "from ensemble import distributed\n"
        "info = distributed.initialize()\n"
        "from rollout.ppo import PPOConfig, train\n"
        "cfg = PPOConfig.for_env('cartpole', members=2, total_steps=512, num_envs=2,\n"
        "                        num_steps=64)\n"
        "try:\n"
        "    train(cfg, out=sys.argv[1], progress=False,\n"
        "          checkpoint_every=1 + info.process_id)\n"
        "except ValueError as e:\n"
        "    print('refused:', e, flush=True)\n"
        "    sys.exit(3)\n"
    )
    cmd = [sys.executable, "-m", "ensemble.launch", "-n", "2", "--", sys.executable,
           str(script), str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "refused: the processes of this run were started with different settings (these " \
        "differ between them: checkpoint_every)" in proc.stdout, proc.stdout[-3000:]  # fmt: skip


@pytest.mark.timeout(120)
def test_processes_that_build_ensembles_of_different_n_are_told_so_on_both():
    """Process 0 built 4 members and process 1 2 over the same 4 devices: even init ran, each
    making global arrays of its own shape ((4, ...) on one, (2, ...) on the other), so every
    later program was another one per process, where a collective aborts in gloo, naming
    nothing. An ensemble on a process's own devices may differ."""
    # Printed to stderr, away from Gloo's notes on stdout (see the member-batch test).
    script = (
        "import os, sys, functools, jax, jax.numpy as jnp, flax.linen as nn\n"
        "from ensemble import build, distributed\n"
        "print = functools.partial(print, file=sys.stderr, flush=True)\n"
        "distributed.initialize()\n"
        "mine = build(nn.Dense(2), 2, devices=jax.local_devices())  # this process's own: free\n"
        "n = 2 if os.environ['ENSEMBLE_PROCESS_ID'] == '1' else 4\n"
        "try:\n"
        "    build(nn.Dense(2), n)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
        "print('same:', build(nn.Dense(2), 4).n)\n"
        "devices = jax.devices() if os.environ['ENSEMBLE_PROCESS_ID'] == '0' else (\n"
        "    jax.devices()[2:] + jax.devices()[:2])  # the same devices in another order\n"
        "try:\n"
        "    build(nn.Dense(2), 4, devices=devices)\n"
        "except ValueError as e:\n"
        "    print('refused:', str(e).split(';')[0])\n"
        "jax.config.update('jax_enable_x64', os.environ['ENSEMBLE_PROCESS_ID'] == '1')\n"
        "try:  # its members would compute in float64, the others' in float32\n"
        "    build(nn.Dense(2), 4)\n"
        "except ValueError as e:\n"
        "    print('refused:', str(e).split(';')[0])\n"
    )
    code, out, err = _launch_quiet([sys.executable, "-c", script], 2, devices_per_process=2)
    assert code == 0, err[-3000:]
    lines = sorted(
        line for line in err.splitlines() if re.match(r"\[rank \d\] (refused|same)", line)
    )
    assert lines == [
        "[rank 0] refused: ensemble.build: the processes built an ensemble over their devices "
        "with different devices",
        "[rank 0] refused: ensemble.build: the processes built an ensemble over their devices "
        "with different jax_enable_x64",
        "[rank 0] refused: ensemble.build: the processes built an ensemble over their devices "
        "with different n; every process builds the same ensemble (the same n, model_parallel, "
        "devices or mesh, in_axes and axis_name), in the same order, under the same JAX "
        "settings (JAX_ENABLE_X64, JAX_DEFAULT_PRNG_IMPL, ...).",
        "[rank 0] same: 4",
        "[rank 1] refused: ensemble.build: the processes built an ensemble over their devices "
        "with different devices",
        "[rank 1] refused: ensemble.build: the processes built an ensemble over their devices "
        "with different jax_enable_x64",
        "[rank 1] refused: ensemble.build: the processes built an ensemble over their devices "
        "with different n; every process builds the same ensemble (the same n, model_parallel, "
        "devices or mesh, in_axes and axis_name), in the same order, under the same JAX "
        "settings (JAX_ENABLE_X64, JAX_DEFAULT_PRNG_IMPL, ...).",
        "[rank 1] same: 4",
    ], out + err


def test_metadata_changed_by_a_flipped_bit_is_damage_not_another_value(tmp_path):
    """A flipped bit of a digit in _CHECKPOINT_METADATA gave {'step': 0} for {'step': 1}."""
    saved = distributed.save_checkpoint(tmp_path / "c", {"w": jnp.ones(2)}, metadata={"step": 1})
    path = Path(saved)
    meta = path / "_CHECKPOINT_METADATA"
    raw = meta.read_bytes()
    assert raw.count(b'"step": 1') == 1
    meta.write_bytes(raw.replace(b'"step": 1', b'"step": 0'))
    with pytest.raises(distributed.DamagedCheckpoint, match="does not match the checksum saved"):
        distributed.checkpoint_metadata(path)


def test_an_orbax_checkpoint_manager_step_is_named_not_called_damaged(tmp_path):
    import orbax.checkpoint as ocp

    tree = {"w": jnp.arange(3.0)}
    with ocp.CheckpointManager(tmp_path / "mgr") as manager:
        manager.save(5, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    step = tmp_path / "mgr" / "5"
    items = [d.name for d in step.iterdir() if (d / "_METADATA").exists()]
    assert items, list(step.iterdir())
    for where, said in ((step, "holds orbax items"), (step / items[0], "is an item of")):
        for read in (lambda p: distributed.restore_checkpoint(p, tree),
                     distributed.checkpoint_metadata):  # fmt: skip
            with pytest.raises(FileNotFoundError, match=said):
                read(where)


def test_spellings_of_one_matmul_precision_compare_equal():
    """highest on one process and float32 on another lower to the same dots: refused."""
    said = []
    for spelling in ("highest", "float32", "default", None, "bfloat16", "tensorfloat32", "high"):
        with jax.default_matmul_precision(spelling):
            said.append(distributed.numeric_jax_settings()["jax_default_matmul_precision"])
    assert said == ["HIGHEST", "HIGHEST", "DEFAULT", "DEFAULT", "DEFAULT", "HIGH", "HIGH"]


def test_a_checkpoint_saved_with_x64_read_without_it_is_said_not_called_damaged(tmp_path):
    """Orbax reads a float64 leaf as float32 without x64: its bits matched neither the values
    nor the checksum, and an intact checkpoint was called damaged (the dtype error's own advice,
    a float64 like, led there). NumPy and Python values narrow as JAX narrows them."""
    path = tmp_path / "c"
    save = (
        "import sys, jax, jax.numpy as jnp, numpy as np\n"
        "from ensemble import distributed\n"
        "distributed.save_checkpoint(sys.argv[1], {'w': jnp.arange(4.0) / 3, 'i': jnp.arange(4),"
        " 'lr': np.float64(0.1), 'step': 5})\n"
    )
    env = {**clean_env(), "JAX_ENABLE_X64": "1"}
    subprocess.run([sys.executable, "-c", save, str(path)], env=env, check=True, timeout=120)
    s = member_sharding(make_mesh(4), 1)
    like = {"i": jnp.zeros(4, jnp.int32), "lr": jnp.zeros(()), "step": jnp.zeros((), int)}
    for w in (jax.device_put(jnp.zeros(4), s), jax.ShapeDtypeStruct((4,), np.float64, sharding=s)):
        with pytest.raises(ValueError, match=r"like\['i'\]: the checkpoint's leaf is int64, saved "
                           r"with x64 on: read it with x64 on too \(JAX_ENABLE_X64=1"):  # fmt: skip
            distributed.restore_checkpoint(path, {**like, "w": w})
    back = distributed.restore_checkpoint(path, {k: like[k] for k in ("lr", "step")}, partial=True)
    assert back["lr"].dtype == jnp.float32 and back["lr"] == np.float32(0.1), back
    assert back["step"] == 5
