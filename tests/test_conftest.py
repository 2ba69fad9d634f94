"""The suite's own configuration works without its optional pytest plugins."""

from __future__ import annotations

import subprocess
import sys

from subprocess_env import ROOT, clean_env


def test_suite_runs_without_pytest_xdist():
    # One process holds an accelerator at a time, so on a GPU or TPU host the suite runs in one
    # process (`-p no:xdist`, or where pytest-xdist is not installed).
    cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-o", "addopts=", "-q",
           "tests/test_reduce.py::test_mean_and_variance"]  # fmt: skip
    env = clean_env()
    for var in ("PYTEST_XDIST_WORKER", "SHARDED_ENSEMBLES_TEST_SESSION"):  # a session of its own
        env.pop(var, None)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
