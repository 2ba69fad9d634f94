"""The example and benchmark scripts' command lines: a mistake is one line on stderr, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from subprocess_env import ROOT, clean_env


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "script, args, message",
    [
        ("examples/cpu_rollout.py", ["--nope"], "error: unrecognized arguments: --nope"),
        ("examples/cpu_rollout.py", ["--workers", "0"], "error: --workers must be >= 1, got 0"),
        ("examples/deep_ensemble.py", ["--members"], "error: argument --members: expected one"),
        ("examples/memory_reduction.py", ["--batch", "-1"], "error: --batch must be >= 1"),
        ("benchmarks/envs.py", ["--num-envs", "0"], "expected an integer >= 1, got '0'"),
    ],
)
def test_a_mistake_is_one_line_and_exit_code_2(script, args, message):
    proc = subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        capture_output=True,
        text=True,
        timeout=100,
        env=clean_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert lines[0].endswith("--help)")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_starts_as_the_readme_runs_it(script):
    """`python benchmarks/<script> --help` from the repository root: each imports the project's
    packages, not a file of benchmarks/ that shares a package's name."""
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--help"],
        capture_output=True,
        text=True,
        timeout=100,
        env=clean_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]
