"""python -m ensemble.launch under faults: a port already in use, and who failed first.

No JAX runs inside the launched processes: stand-ins play the coordinator and the ranks, so
each case takes a second or two.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import pytest
from subprocess_env import clean_env

from ensemble import launch as launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Rank 0 listens on the coordinator port (as JAX's coordinator does), then both ranks wait.
_COORDINATOR = (
    "import os, socket, time\n"
    "rank = os.environ['ENSEMBLE_PROCESS_ID']\n"
    "if rank == '0':\n"
    "    s = socket.socket()\n"
    "    s.bind(('127.0.0.1', int(os.environ['JAX_COORDINATOR_ADDRESS'].rsplit(':', 1)[1])))\n"
    "    s.listen()\n"
    "open(os.environ['READY'] + rank, 'w').write(str(os.getpid()))\n"
    "time.sleep(120)\n"
)


@pytest.mark.timeout(90)
def test_a_second_launch_on_a_busy_port_is_refused_and_the_first_job_survives(tmp_path):
    port = launcher.free_port()
    env = dict(clean_env(), READY=str(tmp_path / "ready"))
    first = subprocess.Popen(
        [sys.executable, "-m", "ensemble.launch", "-n", "2", "--port", str(port), "--grace", "1",
         "--", sys.executable, "-c", _COORDINATOR],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        ready = [tmp_path / f"ready{r}" for r in range(2)]
        deadline = time.monotonic() + 60
        while not all(f.exists() and f.read_text() for f in ready):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first job never started"
            time.sleep(0.05)
        started = tmp_path / "second-started"
        second = subprocess.run(
            [sys.executable, "-m", "ensemble.launch", "-n", "2", "--port", str(port), "--",
             sys.executable, "-c", f"open({str(started)!r}, 'w')"],
            cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"port {port} is already in use" in lines[0], lines
        assert "Traceback" not in second.stderr
        assert not started.exists(), "the second launch started its command"
        time.sleep(0.5)
        assert first.poll() is None, "the first job was disturbed"
        for f in ready:  # both of its processes are alive
            os.kill(int(f.read_text()), 0)
    finally:
        first.terminate()
        first.communicate(timeout=30)
    assert first.returncode == 143


def test_port_in_use_and_bad_port_in_the_api():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert launcher.port_in_use(port)
        with pytest.raises(OSError, match=f"port {port} is already in use"):
            launcher.launch([sys.executable, "-c", "pass"], 1, port=port)
    assert not launcher.port_in_use(port)  # closed: free again
    with pytest.raises(ValueError, match=r"port must be in 1\.\.65535"):
        launcher.launch([sys.executable, "-c", "pass"], 1, port=70000)
    for kw, match in [
        ({"timeout": -5.0}, "timeout must be a positive number"),
        ({"timeout": float("nan")}, "timeout must be a positive number"),
        ({"grace": -1.0}, "grace must be a number of seconds >= 0"),
        ({"grace": float("nan")}, "grace must be a number of seconds >= 0"),
        ({"signal_grace": -1.0}, "signal_grace must be a number of seconds >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):  # before any process starts
            launcher.launch([sys.executable, "-c", "pass"], 1, **kw)


# Rank 1 fails with code 3 and ends at once; rank 0 notices the closed connection and ends 100 ms
# later with code 1: both well within the grace period, and far enough apart that a loaded
# machine's scheduling (20 ms gaps were misordered in CI under a load of 6 on 2 cores) cannot
# swap the order in which the launcher's threads see them end.
_CASCADE = (
    "import os, socket, sys, time\n"
    "rank, port = os.environ['ENSEMBLE_PROCESS_ID'], int(os.environ['PEER_PORT'])\n"
    "if rank == '0':\n"
    "    s = socket.socket(); s.bind(('127.0.0.1', port)); s.listen()\n"
    "    conn, _ = s.accept(); conn.recv(1)\n"
    "    if os.environ.get('SAY'): print(os.environ['SAY'], file=sys.stderr, flush=True)\n"
    "    time.sleep(0.1); os._exit(1)\n"
    "if rank == '1':\n"
    "    while True:\n"
    "        try: c = socket.create_connection(('127.0.0.1', port)); break\n"
    "        except OSError: time.sleep(0.01)\n"
    "    time.sleep(0.3)\n"
    "    if os.environ.get('SLOW_EXIT'): c.close(); time.sleep(float(os.environ['SLOW_EXIT']))\n"
    "    os._exit(3)\n"
    "time.sleep(60)\n"
)


def _cascade(**env: str) -> tuple[int, str]:
    env = dict(clean_env(), PEER_PORT=str(launcher.free_port()), **env)
    err = io.BytesIO()
    code = launcher.launch(
        [sys.executable, "-c", _CASCADE], 3, env=env, stdout=io.BytesIO(), stderr=err, grace=3
    )
    return code, err.getvalue().decode()


def _assert_rank_1_blamed(code: int, text: str) -> None:
    assert code == 3, text
    assert "rank 1 exited with code 3; stopping the other processes" in text, text
    assert "rank 0 exited with code 1; stopping" not in text, text
    assert "exit code 3: rank 1 failed first (exited with code 3)" in text, text


@pytest.mark.timeout(120)
def test_the_rank_that_ended_first_is_blamed_not_the_lowest():
    for _ in range(4):
        _assert_rank_1_blamed(*_cascade())


@pytest.mark.timeout(120)
def test_a_rank_that_reports_a_dead_peer_is_not_blamed_though_it_ends_first():
    # Rank 1 drops its connection, then takes 1 s to end (tearing down); rank 0 prints JAX's
    # peer-failure message and ends first.
    say = "Terminating process because ... This most likely indicates that another task died"
    _assert_rank_1_blamed(*_cascade(SAY=say, SLOW_EXIT="1.0"))
    # Without the message, rank 0 did end first and is blamed.
    code, text = _cascade(SLOW_EXIT="1.0")
    assert code == 1 and "exit code 1: rank 0 failed first" in text, text


@pytest.mark.timeout(60)
def test_a_run_whose_processes_all_blame_a_peer_fails_with_the_first_code():
    # What a failed JAX shutdown barrier does (a rank that called sys.exit(3) waits there for
    # the others): every process prints JAX's peer-failure line and aborts. The launcher used
    # to wait for a root cause that never came, and returned 0 once all had ended.
    script = (
        "import os, sys, time\n"
        "rank = int(os.environ['ENSEMBLE_PROCESS_ID'])\n"
        "time.sleep(0.1 * (1 - rank))\n"
        "print('This most likely indicates that another task died', file=sys.stderr, flush=True)\n"
        "os._exit(7 if rank == 1 else 5)\n"
    )
    err = io.BytesIO()
    start = time.monotonic()
    code = launcher.launch(
        [sys.executable, "-c", script], 2, env=clean_env(), stdout=io.BytesIO(), stderr=err,
        grace=30,
    )  # fmt: skip
    text = err.getvalue().decode()
    assert code == 7, text
    assert "exit code 7: rank 1 failed first (exited with code 7)" in text, text
    assert time.monotonic() - start < 20  # not the 30 s grace: nobody was left to wait for


@pytest.mark.timeout(60)
def test_launcher_cli_mistakes_are_one_line_exit_2():
    many = ["-n", "100000", "--", "true"]  # refused, not 100000 processes started
    for args in (["-n", "2"], ["-n", "x", "--", "true"], ["-n", "0", "--", "true"], many):
        res = subprocess.run(
            [sys.executable, "-m", "ensemble.launch", *args],
            cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=50,
        )  # fmt: skip
        assert res.returncode == 2, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1, (args, res.stderr)
        assert res.stderr.startswith("error: "), res.stderr
        if args is many:
            assert "more than 4 per CPU core" in res.stderr, res.stderr
