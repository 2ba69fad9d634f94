"""CPU device setup: one JAX CPU device per core (small ops on one thread), set before JAX starts.

How this relates to the other devices:

- On a GPU/TPU host the accelerator devices are untouched; this only shapes JAX's *CPU* client,
  which is what ``on_cpu(..., executor='inprocess')`` spreads its work over.
- On a CPU-only host (CI, laptops, this project's tests) the CPU devices *are* the devices the
  jitted, sharded step runs on: ``conftest.py`` (at the repository root) asks for 8 of them to
  simulate 8 accelerators. Those same devices would serve the in-process executor, which is
  exactly the situation that deadlocks, so ``on_cpu`` uses worker processes there; workers have
  their own JAX with one CPU device each, whatever count was configured here.
"""

from __future__ import annotations

import os
from typing import Any

# Small ops on one thread per device. Nothing else: XLA stops reading XLA_FLAGS at the first word
# that is not a --flag, so the often-copied "intra_op_parallelism_threads=1" (not an XLA flag)
# silently disabled every flag written after it.
THREAD_FLAG = "--xla_cpu_multi_thread_eigen=false"
_NOT_AN_XLA_FLAG = "intra_op_parallelism_threads"


def with_thread_flag(flags: str, *, drop: tuple[str, ...] = ()) -> str:
    """``XLA_FLAGS`` value: ``flags`` with one thread per device, flags starting ``drop`` removed.

    Example:
      >>> with_thread_flag("--xla_dump_to=/tmp/d intra_op_parallelism_threads=1")
      '--xla_dump_to=/tmp/d --xla_cpu_multi_thread_eigen=false'
    """
    drop = ("--xla_cpu_multi_thread_eigen", _NOT_AN_XLA_FLAG, *drop)
    return " ".join([*(f for f in flags.split() if not f.startswith(drop)), THREAD_FLAG])


def available_cores() -> int:
    """CPU cores this process may use (``os.sched_getaffinity`` where available)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


_CGROUP = "/sys/fs/cgroup"  # cgroup v2: this process's limits, in a container


def memory_of(devices: Any, local: Any) -> tuple[int | None, str, bool]:
    """(bytes, their description, on CPU) for programs on ``devices``: this host's free memory
    where they are CPU devices (they share it), else the memory of ``local``, one of them of
    this process (others refuse ``memory_stats``); None bytes where it cannot be read."""
    if all(d.platform == "cpu" for d in devices):
        return available_memory(), "this host's free memory", True
    have = (local.memory_stats() or {}).get("bytes_limit")
    return have, f"the memory of one {local.device_kind}", False


def beyond_free_memory(need: int, what: str) -> str | None:
    """One line refusing ``need`` bytes of ``what`` where they exceed :func:`available_memory`
    (None where they fit, or it cannot be read): for scripts' size flags, whose typos were
    a RESOURCE_EXHAUSTED traceback, or an abort inside XLA."""
    have = available_memory()
    if have is None or need <= have:
        return None
    return f"{what}: at least {need / 1e9:,.1f} GB, more than this host's {have / 1e9:,.1f} GB free"


def available_memory() -> int | None:
    """Bytes of host memory this process may still take: the kernel's ``MemAvailable``, or the
    cgroup's limit less its use (page cache, which the kernel reclaims, not counted) where that
    is smaller; ``None`` where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    cgroup = _CGROUP
    try:
        with open(f"{cgroup}/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open(f"{cgroup}/memory.current") as f:
                used = int(f.read().strip())
            with open(f"{cgroup}/memory.stat") as f:
                stat = dict(line.split()[:2] for line in f if line.strip())
            found.append(int(limit) - used + int(stat.get("file", 0)))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def configure_cpu_devices(n: int | None = None) -> int:
    """Give this process ``n`` JAX CPU devices (default: its CPU cores), one thread each.

    Call it right after ``import jax`` and before any JAX computation (XLA reads its flags and
    the device count once, when the first backend starts). It sets ``jax_num_cpu_devices`` and
    adds ``--xla_cpu_multi_thread_eigen=false`` to ``XLA_FLAGS``
    (other flags are kept; a conflicting ``--xla_force_host_platform_device_count`` is dropped),
    so that a device runs its small ops on one thread instead of each one spawning a thread per
    core. Large ops are not confined: with jaxlib 0.10 a single device's 256x1024 @ 1024x1024
    matmuls kept 1.75-1.9 of 2 cores busy, so on a CPU host n devices do not run large ops n
    times faster than one (on accelerators each device is its own chip).

    Calling it again with the count JAX already has is a no-op, so a library and a script (or a
    test's conftest) can both call it. Accelerator devices are not affected.

    Args:
      n: number of CPU devices; default ``len(os.sched_getaffinity(0))``.

    Returns:
      The number of JAX CPU devices.

    Raises:
      RuntimeError: JAX's CPU backend already started with a different count. Call this before
        any JAX operation, or set ``JAX_NUM_CPU_DEVICES=n`` in the environment instead.

    Example:
      >>> import jax
      >>> import rollout
      >>> n = rollout.configure_cpu_devices(len(jax.devices("cpu")))  # no-op if already so
      >>> len(jax.devices("cpu")) == n
      True
    """
    import jax

    if n is None:
        n = available_cores()
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"configure_cpu_devices: n must be a positive int, got {n!r}")
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        # The backend has started; the count is fixed now. Fine if it is the one we want.
        have = len(jax.devices("cpu"))
        if have == n:
            return n
        raise RuntimeError(
            f"configure_cpu_devices({n}): JAX's CPU backend already started with {have} "
            "devices. Call rollout.configure_cpu_devices() right after `import jax`, before any "
            f"JAX operation, or start Python with JAX_NUM_CPU_DEVICES={n}."
        ) from None
    os.environ["XLA_FLAGS"] = with_thread_flag(
        os.environ.get("XLA_FLAGS", ""), drop=("--xla_force_host_platform_device_count",)
    )
    return n
