"""One ensemble over several processes (hosts) on JAX's own distributed runtime.

Call :func:`initialize` first, before any other JAX call; then ``ensemble.build`` makes one mesh
across every process's devices and each process holds only its own members. See
``docs/DISTRIBUTED.md`` and ``python -m ensemble.launch --help``.

Example (alone, or as ``python -m ensemble.launch -n 2 --devices-per-process 2 -- python s.py``):
  >>> from ensemble import distributed
  >>> info = distributed.initialize()
  >>> info.num_processes >= 1
  True
"""

from ensemble._distributed import (
    NUMERIC_JAX_SETTINGS,
    DamagedCheckpoint,
    ProcessInfo,
    checkpoint_metadata,
    gather_metrics_to_host,
    initialize,
    is_main_process,
    member_batch_from_local,
    numeric_jax_settings,
    process_local_members,
    restore_checkpoint,
    save_checkpoint,
    settings_that_differ,
)

__all__ = [
    "NUMERIC_JAX_SETTINGS",
    "DamagedCheckpoint",
    "ProcessInfo",
    "checkpoint_metadata",
    "gather_metrics_to_host",
    "initialize",
    "is_main_process",
    "member_batch_from_local",
    "numeric_jax_settings",
    "process_local_members",
    "restore_checkpoint",
    "save_checkpoint",
    "settings_that_differ",
]
