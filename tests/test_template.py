"""Workers forked from a template process (rollout._template): what a fresh interpreter gave them
(own cwd, own NumPy global draws, exit codes, signals), one template per environment, none left
behind, and the plain start with ROLLOUT_FORK_WORKERS=0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_env import alive, alive_after, clean_env, workers_of

from rollout import _spawn, _template, on_cpu

pytestmark = pytest.mark.skipif(not _template.enabled(), reason="templates are Linux only")

WORKER = """
import os, socket, sys, time
import numpy as np

def serve(fd):
    sock = socket.socket(fileno=fd)
    how = sock.recv(64).decode()
    seen = os.environ.get("TEMPLATE_TEST_VAR", "-")
    sock.sendall(f"{np.random.rand()!r} {os.getcwd()} {os.getppid()} {seen}".encode())
    if how == "sleep":
        time.sleep(60)
    elif how == "exit3":
        raise SystemExit(3)
    elif how == "raise":
        raise ValueError("the worker fell over")
"""


def _start(proc_env: dict[str, str], script: Path, how: str) -> tuple[object, list[str]]:
    proc, sock = _spawn.spawn(str(script), proc_env, "test-worker", ("numpy",), 60.0)
    with sock:
        sock.sendall(how.encode())
        sock.settimeout(30)
        return proc, sock.recv(4096).decode().split()


@pytest.mark.timeout(120)
def test_forked_workers_differ_like_fresh_ones_and_report_how_they_ended(tmp_path, monkeypatch):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, TEMPLATE_TEST=str(tmp_path))  # a template of this test's own
    (tmp_path / "elsewhere").mkdir()

    here = os.getcwd()
    first, (draw_a, cwd_a, parent_a, _) = _start(env, script, "ok")
    monkeypatch.chdir(tmp_path / "elsewhere")
    second, (draw_b, cwd_b, parent_b, _) = _start(env, script, "ok")
    assert draw_a != draw_b  # a fork would repeat the template's global NumPy draws
    assert cwd_a == here and cwd_b == str(tmp_path / "elsewhere")  # the parent's, when forked
    template = _template.template_for(env, ("numpy",), 60.0)
    assert int(parent_a) == int(parent_b) == template.pid != os.getpid()
    assert first.wait(10) == 0 and second.wait(10) == 0

    sleeper, _ = _start(env, script, "sleep")
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.2)
    sleeper.kill()
    assert sleeper.wait(10) == -signal.SIGKILL
    assert _spawn.exit_text(sleeper.returncode, "") == "was killed by signal SIGKILL (exit code -9)"
    assert _start(env, script, "exit3")[0].wait(10) == 3
    assert _start(env, script, "raise")[0].wait(10) == 1


@pytest.mark.timeout(120)
def test_a_worker_gets_the_environment_asked_for_and_templates_follow_it(tmp_path):
    """A variable that names the running test changes only the worker's environment; any other
    change starts a new template, and the old one ends with its last worker."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, TEMPLATE_TEST=str(tmp_path))
    env.pop("TEMPLATE_TEST_VAR", None)
    sleeper, (_, _, old, seen) = _start(env, script, "sleep")
    assert seen == "-"
    now = dict(env, PYTEST_CURRENT_TEST="another test (call)")
    done, (_, _, same, _) = _start(now, script, "ok")
    assert same == old and done.wait(10) == 0
    changed = dict(env, TEMPLATE_TEST_VAR="on")
    done, (_, _, new, seen) = _start(changed, script, "ok")
    assert seen == "on" and new != old and done.wait(10) == 0
    assert alive(int(old))  # retired, but its worker still runs
    sleeper.kill()
    assert sleeper.wait(10) == -signal.SIGKILL
    assert alive_after([int(old)], 5.0) == []


@pytest.mark.timeout(120)
def test_a_template_and_its_workers_end_with_a_sigkilled_parent(tmp_path):
    """The parent dies without a word: the template kills its workers, even one in a step that
    never returns, and ends."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    parent = textwrap.dedent(f"""
        import os, sys, time
        from rollout import _spawn
        proc, sock = _spawn.spawn({str(script)!r}, dict(os.environ), "w", ("numpy",), 60.0)
        sock.sendall(b"sleep")
        sock.recv(4096)
        from rollout import _template
        (template,) = _template._templates.values()
        print(template.pid, proc.pid, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], env=clean_env(),
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(map(alive, pids)), pids
    finally:
        proc.kill()
        proc.wait()
    assert alive_after(pids, 5.0) == []


@pytest.mark.timeout(120)
def test_pools_share_one_template_per_environment_and_can_start_fresh(monkeypatch):
    f = on_cpu(lambda x: x * 2, workers=3, executor="process")
    g = on_cpu(lambda x: x + 1, workers=2, executor="process")
    try:
        np.testing.assert_array_equal(f(jnp.arange(6.0)), np.arange(6.0) * 2)
        np.testing.assert_array_equal(g(jnp.arange(6.0)), np.arange(6.0) + 1)
        parents = {_ppid(pid) for pid in f.pids + g.pids}
        assert len(parents) == 1 and parents != {os.getpid()}  # two pools, one template
        assert "_template.py" in Path(f"/proc/{parents.pop()}/cmdline").read_text()
        assert sorted(workers_of(os.getpid(), "on_cpu")) == sorted(f.pids + g.pids)

        # Without templates, the workers are this process's own children.
        monkeypatch.setenv("ROLLOUT_FORK_WORKERS", "0")
        g.close()  # the next call starts the workers again, now fresh
        np.testing.assert_array_equal(g(jnp.arange(6.0)), np.arange(6.0) + 1)
        assert {_ppid(pid) for pid in g.pids} == {os.getpid()}
        assert sorted(workers_of(os.getpid(), "on_cpu")) == sorted(f.pids + g.pids)
    finally:
        f.close()
        g.close()


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(60)
def test_a_template_that_cannot_start_leaves_the_worker_to_start_fresh(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER + "\nif __name__ == '__main__':\n    serve(int(sys.argv[1]))\n")
    env = dict(os.environ, PYTHONPATH="", PYTHONHOME=str(tmp_path / "no-python-here"))
    start = time.monotonic()
    proc, sock = _spawn.spawn(str(script), env, "test-worker", ("numpy",), 30.0)
    with sock:
        proc.wait(30)
    assert isinstance(proc, subprocess.Popen) and proc.returncode != 0
    assert time.monotonic() - start < 30


@pytest.mark.timeout(120)
def test_without_working_pidfds_workers_start_fresh():
    """A kernel or sandbox without pidfd_open (gVisor answers ENOSYS) gets fresh workers, not
    a template whose every fork fails (its workers then never started)."""
    script = textwrap.dedent("""
        import errno, os
        from pathlib import Path

        def enosys(pid, flags=0):
            raise OSError(errno.ENOSYS, "Function not implemented")

        os.pidfd_open = enosys  # what gVisor answers
        import jax.numpy as jnp, numpy as np
        from rollout import _template, on_cpu

        assert not _template.enabled()
        f = on_cpu(lambda x: x + 1, workers=2, executor="process")
        np.testing.assert_array_equal(f(jnp.zeros((4, 2))), np.ones((4, 2)))
        stat = lambda pid: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert {int(stat(pid)[1]) for pid in f.pids} == {os.getpid()}  # no template between
        f.close()
        print("ok")
    """)  # fmt: skip
    res = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True,
                         text=True, timeout=100)  # fmt: skip
    assert res.stdout.split() == ["ok"], res.stdout + res.stderr[-3000:]
