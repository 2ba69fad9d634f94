"""rollout.configure_cpu_devices: device count and one thread per device, before JAX starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import pytest

from rollout import configure_cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_same_count_after_start_is_a_no_op_and_another_count_is_an_error():
    assert len(jax.devices()) == 8  # conftest's simulated devices; the backend is now started
    assert configure_cpu_devices(8) == 8
    with pytest.raises(RuntimeError, match=r"already started with 8 devices.*JAX_NUM_CPU_DEVICES"):
        configure_cpu_devices(3)
    with pytest.raises(ValueError, match="positive int"):
        configure_cpu_devices(0)


@pytest.mark.timeout(60)
def test_fresh_process_gets_n_devices_and_thread_flags(tmp_path):
    """Also: a user's flags written after the often-copied ``intra_op_parallelism_threads=1``
    (not an XLA flag; XLA stops reading at it) take effect once configured."""
    dump = tmp_path / "dump"
    script = textwrap.dedent(
        f"""
        import os
        os.environ["XLA_FLAGS"] = (
            "--xla_force_host_platform_device_count=5 intra_op_parallelism_threads=1 "
            "--xla_dump_to={dump}"
        )
        import jax, rollout
        print(rollout.configure_cpu_devices(3))
        print(len(jax.devices("cpu")))
        print(os.environ["XLA_FLAGS"])
        jax.jit(lambda x: x + 1)(1.0).block_until_ready()
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = ROOT
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50, env=env
    )
    assert res.returncode == 0, res.stderr[-2000:]
    n, devices, flags = res.stdout.strip().splitlines()
    assert (n, devices) == ("3", "3")
    assert flags.split() == [f"--xla_dump_to={dump}", "--xla_cpu_multi_thread_eigen=false"]
    assert dump.is_dir() and any(dump.iterdir())  # the user's flag was read by XLA


def test_available_memory_takes_the_cgroup_limit_less_its_use_but_not_its_page_cache(
    tmp_path, monkeypatch
):
    import rollout._devices as devices

    (tmp_path / "memory.max").write_text("8000000000\n")
    (tmp_path / "memory.current").write_text("3000000000\n")
    (tmp_path / "memory.stat").write_text("anon 1000000000\nfile 2000000000\nshmem 0\n")
    monkeypatch.setattr(devices, "_CGROUP", str(tmp_path))
    host = devices.available_memory()
    assert host is not None and 0 < host <= 7_000_000_000  # MemAvailable, or the cgroup's
    (tmp_path / "memory.max").write_text("2000000000\n")  # now the cgroup's is the smaller
    assert devices.available_memory() == 2_000_000_000 - 3_000_000_000 + 2_000_000_000
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the kernel's figure alone
    kernel = devices.available_memory()
    assert kernel is not None and kernel > 0
