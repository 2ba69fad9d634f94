"""One ensemble over several processes (hosts) on JAX's own distributed runtime.

Every process runs the same program. :func:`initialize` joins the processes into one JAX
runtime (``jax.distributed.initialize``) before anything touches a backend; after it,
``jax.devices()`` lists the devices of *all* processes, so ``ensemble.make_mesh(n)`` builds one
mesh across them and each process holds only the members that live on its own devices.

Where the settings come from, first match wins:

1. the arguments of :func:`initialize` (a process count or id that contradicts the variables
   of 2. is refused: under the launcher, every process would take the one id, or wait for
   processes that never come);
2. the variables ``python -m ensemble.launch`` sets (:data:`ENV_NUM_PROCESSES`,
   :data:`ENV_PROCESS_ID`, and JAX's own ``JAX_COORDINATOR_ADDRESS``), which a user may also set by
   hand on each host;
3. the cluster detection of ``jax.distributed`` (SLURM, Open MPI, Kubernetes, Cloud TPU);
4. none of these: a plain single-process run (nothing to join), so the same script works on a
   laptop.

Example (a script run as ``python -m ensemble.launch -n 2 --devices-per-process 2 -- python s.py``,
or alone as ``python s.py``):

  >>> from ensemble import _distributed as distributed
  >>> info = distributed.initialize()          # before any other JAX call
  >>> info.num_processes >= 1
  True
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import ipaddress
import itertools
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ensemble._core import check_live
from ensemble._mesh import MEMBER_AXIS, check_mesh

logger = logging.getLogger(__name__)

#: Number of processes (our own name; JAX only detects it on SLURM / Open MPI / Kubernetes / TPU).
ENV_NUM_PROCESSES = "ENSEMBLE_NUM_PROCESSES"
#: This process's id in ``0 .. num_processes - 1``.
ENV_PROCESS_ID = "ENSEMBLE_PROCESS_ID"
#: Seconds without a heartbeat after which a peer counts as dead (optional override).
ENV_HEARTBEAT_TIMEOUT = "ENSEMBLE_HEARTBEAT_TIMEOUT"
#: ``host:port`` of process 0's coordinator; read by ``jax.distributed.initialize`` too.
ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
#: ``host:port`` the coordinator binds; read by ``jax.distributed.initialize`` too. JAX's default
#: is every interface (``[::]:port``); the launcher sets it to loopback.
ENV_COORDINATOR_BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"
#: CPU devices of this process; read by JAX's config (``jax_num_cpu_devices``) too.
ENV_NUM_CPU_DEVICES = "JAX_NUM_CPU_DEVICES"
#: CPU collectives between processes; read by JAX's config too. We always use ``gloo``.
ENV_CPU_COLLECTIVES = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the run, as :func:`initialize` left it.

    Example:
      >>> import jax
      >>> info = initialize()  # alone: process 0 of 1, with every local device
      >>> info.is_main, info.num_processes, info.device_count == jax.device_count()
      (True, 1, True)
    """

    process_id: int
    num_processes: int
    coordinator_address: str | None
    local_device_count: int
    device_count: int

    @property
    def is_main(self) -> bool:
        """True on process 0: the one that prints, writes metrics and plots."""
        return self.process_id == 0


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_cpu_devices: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    shutdown_timeout_seconds: int = 120,
    initialization_timeout: int = 120,
) -> ProcessInfo:
    """Joins this process to the run; call it first, before any other JAX computation.

    Sets the CPU device count (``local_cpu_devices``) and gloo CPU collectives, then calls
    ``jax.distributed.initialize`` when the run has several processes (see the module docstring
    for where the settings come from). Calling it again returns the same answer.

    A dead peer does not hang the others: JAX's coordination service notices the missing
    heartbeats after ``heartbeat_timeout_seconds`` (default 30, or ``$ENSEMBLE_HEARTBEAT_TIMEOUT``;
    JAX's own default is 100) and terminates every remaining process with "the JAX distributed
    service detected fatal errors". A dead process 0 (the coordinator) is noticed at once.
    When the coordinator address is a loopback address (one machine, ``ensemble.launch``), the
    coordinator and gloo bind loopback only.

    Args:
      coordinator_address: ``host:port`` of process 0, reachable from every process.
      num_processes: number of processes.
      process_id: this process's id, ``0 .. num_processes - 1``.
      local_cpu_devices: CPU devices this process simulates (``jax_num_cpu_devices``); default:
        ``$JAX_NUM_CPU_DEVICES`` or JAX's default.
      heartbeat_timeout_seconds: seconds without heartbeats before a peer counts as dead.
      shutdown_timeout_seconds: how long a finished process waits at exit for the others.
      initialization_timeout: how long to wait for every process to connect.

    Returns:
      A :class:`ProcessInfo`.

    Example:
      >>> info = initialize()      # single process when no launcher / cluster is around
      >>> info.process_id, info.is_main
      (0, True)
    """
    if jax.distributed.is_initialized():
        return _info()
    if local_cpu_devices is None and os.environ.get(ENV_NUM_CPU_DEVICES):
        local_cpu_devices = int(os.environ[ENV_NUM_CPU_DEVICES])
    if _backends_started():
        _check_not_too_late(num_processes, local_cpu_devices)
        return _info()

    if local_cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", int(local_cpu_devices))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

    settings = resolve_settings(coordinator_address, num_processes, process_id)
    if settings is None:
        return _info()  # a plain single-process run: nothing to join
    coordinator_address, num_processes, process_id = settings

    if heartbeat_timeout_seconds is None:
        heartbeat_timeout_seconds = _env_int(ENV_HEARTBEAT_TIMEOUT) or 30
    bind = None
    if coordinator_address and _is_loopback(coordinator_address):
        # JAX binds the coordinator on every interface by default; one machine needs loopback.
        bind = os.environ.get(ENV_COORDINATOR_BIND_ADDRESS) or coordinator_address
    if process_id == 0:
        _check_coordinator_port(bind or coordinator_address)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        shutdown_timeout_seconds=shutdown_timeout_seconds,
        coordinator_bind_address=bind,
    )
    if bind is not None:
        _gloo_on_loopback()
    _fail_fast_on_uncaught_exceptions()
    info = _info()
    logger.info("joined the run as process %d of %d", info.process_id, info.num_processes)
    return info


def _check_not_too_late(num_processes: int | None, local_cpu_devices: int | None) -> None:
    """The backend has started: too late to join a run or to change the device count. Fine
    only if the caller asked for nothing that needed it."""
    wants_many = (num_processes or _env_int(ENV_NUM_PROCESSES) or 1) > 1
    if wants_many or (local_cpu_devices and local_cpu_devices != jax.local_device_count("cpu")):
        raise RuntimeError(
            "ensemble.distributed.initialize() must run before any JAX computation (the JAX "
            "backend has already started, so devices and processes are fixed). Call it at "
            "the top of your program, right after the imports."
        )


def resolve_settings(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> tuple[str | None, int | None, int | None] | None:
    """The run's ``(coordinator address, processes, process id)`` from the arguments, else the
    environment (see the module docstring); None for a plain single-process run. Incomplete or
    inconsistent settings raise a ``ValueError`` that says what to give. Starts nothing, so a
    CLI can check its flags before it creates any file."""
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR_ADDRESS)
    # A count or id that contradicts the variables (ensemble.launch sets them per process):
    # every process would take the one id (no process 0, so no coordinator), or wait for
    # processes that never come, until all of them abort.
    num_processes = _agreeing("num_processes", num_processes, ENV_NUM_PROCESSES)
    process_id = _agreeing("process_id", process_id, ENV_PROCESS_ID)
    if not _joins_a_run(coordinator_address, num_processes, process_id):
        return None
    return coordinator_address, num_processes, process_id


def _agreeing(name: str, given: int | None, variable: str) -> int | None:
    """``given``, else the variable's value; both and different: one ``ValueError``."""
    found = _env_int(variable)
    if given is not None and found is not None and given != found:
        raise ValueError(
            f"{name}={given} contradicts ${variable}={found} (set by ensemble.launch for each "
            "process, or by hand): leave it out under the launcher, or make the two agree."
        )
    return found if given is None else given


def _joins_a_run(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> bool:
    """Whether these settings (or a detected cluster) make a multi-process run; bad ones raise."""
    explicit = (coordinator_address, num_processes, process_id)
    if all(v is None for v in explicit) and not _cluster_detected():
        return False
    if num_processes == 1 and (process_id or 0) == 0 and not _cluster_detected():
        return False
    if None in explicit and not _cluster_detected():
        raise ValueError(
            f"a multi-process run needs the coordinator address, the number of processes and "
            f"this process's id; got coordinator_address={coordinator_address!r}, "
            f"num_processes={num_processes!r}, process_id={process_id!r}. Pass them to "
            f"initialize(), set ${ENV_COORDINATOR_ADDRESS}, ${ENV_NUM_PROCESSES} and "
            f"${ENV_PROCESS_ID} on every process, or start the processes with "
            "python -m ensemble.launch -n N -- <command>."
        )
    if None not in explicit and not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} must be in 0..num_processes-1 (num_processes="
            f"{num_processes}); give each process its own id."
        )
    if coordinator_address is not None:
        _check_address(coordinator_address)
    _check_against_cluster(coordinator_address, num_processes, process_id)
    return True


def _check_address(address: str) -> None:
    """``host:port``: JAX fails on anything else with a bare IndexError, an OverflowError or
    an abort of the process."""
    host, _, port = address.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator address {address!r} must be host:port with a port in 1..65535 (e.g. "
            "10.0.0.1:1234): the address of process 0, the same on every process."
        )


#: (cluster, process-count variable, process-id variable) of the schedulers JAX detects.
_CLUSTER_VARIABLES = (
    ("Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("Slurm", "SLURM_NTASKS", "SLURM_PROCID"),
)


def _check_against_cluster(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> None:
    """Settings given beside a detected cluster's (SLURM, Open MPI, ...) must agree with it:
    JAX otherwise mixes them (3 processes with SLURM's ids for 2) and waits until it aborts.
    All three given (``ensemble.launch`` inside a SLURM job): JAX asks the cluster nothing."""
    if None not in (coordinator_address, num_processes, process_id):
        return
    # The schedulers' own documented variables, which JAX's detection reads, in its order.
    found = [(c, n, i) for c, n, i in _CLUSTER_VARIABLES if n in os.environ and i in os.environ]
    if not found:
        return
    cluster, count_var, id_var = found[0]
    theirs = {"num_processes": _env_int(count_var), "process_id": _env_int(id_var)}
    ours = {"num_processes": num_processes, "process_id": process_id}
    for name, value in ours.items():
        if value is not None and theirs[name] is not None and value != theirs[name]:
            raise ValueError(
                f"{name}={value} disagrees with the {cluster} cluster's {theirs[name]}: give "
                "the cluster's own settings, or none (they are detected)."
            )


def is_main_process() -> bool:
    """True on process 0 (and in a single-process run): print, log and plot only there.

    Example:
      >>> is_main_process()
      True
    """
    return jax.process_index() == 0


def process_local_members(mesh: Mesh, n: int) -> list[int]:
    """Indices of the members whose parameters (or a part of them) live on this process.

    Members are numbered in mesh order, so with ``make_mesh(4)`` on 2 processes x 2 devices,
    process 0 holds members ``[0, 1]`` and process 1 holds ``[2, 3]``. A member that spans
    devices of several processes is listed on each of them.

    Example:
      >>> from ensemble import make_mesh
      >>> process_local_members(make_mesh(jax.device_count()), jax.device_count()) == list(
      ...     range(jax.device_count()))  # one process: every member
      True
    """
    check_mesh(mesh, n)
    sharding = NamedSharding(mesh, PartitionSpec(MEMBER_AXIS))
    here = jax.process_index()
    members: set[int] = set()
    for device, index in sharding.devices_indices_map((n,)).items():
        if device.process_index == here:
            members.update(range(n)[index[0]])
    return sorted(members)


def member_batch_from_local(local_data: Any, mesh: Mesh, n: int) -> Any:
    """Builds global per-member arrays ``[n, ...]`` from this process's members' data.

    Each process passes only the data of its own members (:func:`process_local_members`, in that
    order): every leaf of ``local_data`` has a leading axis of ``len(process_local_members(mesh,
    n))``. The result is one global array per leaf, member axis sharded over the mesh's member
    axis, without any process holding another's data (``jax.make_array_from_process_local_data``).
    The other axes are replicated over the devices of one member. Collective: every process
    calls it, and the processes' per-member shapes and dtypes are compared (one that differs,
    a last partial batch on one process, say, is a ``ValueError`` on every process; unchecked,
    each process built a global array of another shape).

    Example:
      >>> import numpy as np
      >>> from ensemble import make_mesh
      >>> n = jax.device_count(); mesh = make_mesh(n)
      >>> local = np.ones((len(process_local_members(mesh, n)), 8, 3), np.float32)
      >>> member_batch_from_local(local, mesh, n).shape == (n, 8, 3)
      True
    """
    members = process_local_members(mesh, n)

    def make(path, leaf):
        leaf = np.asarray(leaf)
        if leaf.ndim == 0 or leaf.shape[0] != len(members):
            raise ValueError(
                f"leaf {jax.tree_util.keystr(path)} has shape {leaf.shape}; this process "
                f"(process {jax.process_index()}) holds members {members}, so every leaf needs "
                f"a leading axis of {len(members)} (those members' data, in that order)."
            )
        return leaf

    local = jax.tree_util.tree_map_with_path(make, local_data)
    _refuse_shapes_that_differ(local)
    sharding = NamedSharding(mesh, PartitionSpec(MEMBER_AXIS))
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, x, (n, *x.shape[1:])), local
    )


def _refuse_shapes_that_differ(local: Any) -> None:
    """Raises on every process where the processes' leaves differ in per-member shape or dtype
    (or structure): one checksum each, all-gathered."""
    if jax.process_count() == 1:
        return
    import zlib

    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree_util.tree_flatten_with_path(local)
    mine = [(jax.tree_util.keystr(p), x.shape[1:], str(x.dtype)) for p, x in leaves]
    crc = zlib.crc32(repr((str(treedef), mine)).encode())
    every = np.asarray(multihost_utils.process_allgather(np.asarray([crc], np.uint32)))
    if not (every == every[0]).all():
        others = sorted({int(i) for i in np.flatnonzero(every.reshape(-1) != crc)})
        shown = ", ".join(f"{key or 'leaf'} {shape} {dtype}" for key, shape, dtype in mine)
        raise ValueError(
            f"member_batch_from_local: process {jax.process_index()}'s leaves (per member: "
            f"{shown}) differ in shape or "
            f"dtype from those of process(es) {others}; every process must pass the same "
            "per-member shapes (a last, partial batch on one process: drop or pad it on all)."
        )


def gather_metrics_to_host(tree: Any) -> Any:
    """Brings small arrays (per-member losses, returns) to NumPy on every process.

    Collective: every process must call it with the same tree. Print the result on process 0
    only (:func:`is_main_process`). Meant for metrics; use checkpoints for parameters.

    Example:
      >>> import jax.numpy as jnp
      >>> gather_metrics_to_host({"loss": jnp.arange(3.0)})["loss"].tolist()
      [0.0, 1.0, 2.0]
    """
    from jax.experimental import multihost_utils

    def to_host(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree_util.tree_map(to_host, tree)


#: The key under which :func:`save_checkpoint` keeps its leaves' checksums in the metadata.
_CHECKSUMS_KEY = "_ensemble_checksums"


def row_checksums(leaves: list[jax.Array]) -> list[np.ndarray]:
    """Per leaf, one 32-bit checksum per row of its leading axis (one for a scalar); collective.

    Position-weighted over the raw bits, so a zeroed, truncated or shuffled leaf does not pass
    for the saved one. Each process sums the shards it holds, on the host (no program to
    compile), and the processes add their parts.
    """
    return _summed_over_processes([_shard_sums(x, per_row=True) for x in leaves])


def _leaf_checksums(tree: Any) -> dict[str, int]:
    """One checksum per JAX-array leaf of ``tree`` (the rows' checksums folded), keyed by its
    path's names; collective. NumPy leaves are left out (without x64 a float64 one is read
    back as float32), as are empty ones (orbax refuses them)."""
    named = [
        (json.dumps(_path_names(p)), x)
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if isinstance(x, jax.Array) and x.size
    ]
    sums = _summed_over_processes([_shard_sums(x, per_row=False) for _, x in named])
    return {name: int(s[0]) for (name, _), s in zip(named, sums)}


def _shard_sums(x: jax.Array, per_row: bool) -> np.ndarray:
    """This process's part of ``x``'s checksum: per row, or the rows folded (``[1]``)."""
    x = x.reshape(1) if x.ndim == 0 else x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    rows = np.zeros(x.shape[0], np.uint32)
    weights: dict[tuple, np.ndarray] = {}  # by block and place in the row: shared by shards
    for shard in x.addressable_shards:
        if shard.replica_id != 0:  # each element once, over every process
            continue
        b = _bits(np.asarray(shard.data))  # [*block, e]: e 32-bit words per element
        starts = [s.indices(d)[0] for s, d in zip(shard.index, x.shape)]
        key = (b.shape[1:], tuple(starts[1:]))
        if key not in weights:
            weights[key] = _word_weights(x.shape[1:], b.shape[1:], starts[1:])
        mixed = b >> np.uint32(16)
        mixed ^= b
        mixed *= weights[key][None]
        rows[starts[0] : starts[0] + b.shape[0]] += mixed.reshape(b.shape[0], -1).sum(
            axis=1, dtype=np.uint32
        )
    if per_row:
        return rows
    odd = np.arange(rows.size, dtype=np.uint32) * np.uint32(2) + np.uint32(1)  # none cancels
    return np.array([(rows * odd).sum(dtype=np.uint32)], np.uint32)


def _word_weights(row: tuple, block: tuple, starts: list[int]) -> np.ndarray:
    """``j * 2654435761 + 1`` for each word j of a row's ``block`` (words per element last),
    the block starting at ``starts`` in a row of shape ``row``. All in uint32: only the
    weights mod 2**32 count, and uint32 arithmetic wraps there."""
    u = np.uint32
    strides = np.cumprod((*row, 1)[::-1])[::-1][1:] % 2**32  # a row's, in elements
    col = np.zeros(block[:-1], u)  # each element's place in its row
    for k, (start, stride) in enumerate(zip(starts, strides)):
        place = (np.arange(block[k], dtype=u) + u(start % 2**32)) * u(stride)
        col += place.reshape((-1,) + (1,) * (col.ndim - k - 1))
    e = block[-1]
    word = col[..., None] * u(e) + np.arange(e, dtype=u)
    return word * u(2654435761) + u(1)


def _bits(a: np.ndarray) -> np.ndarray:
    """``a``'s raw bits as ``uint32`` words, ``[*a.shape, e]`` (e per element)."""
    shape = a.shape
    if a.dtype == np.bool_:
        return a.astype(np.uint32)[..., None]
    if np.iscomplexobj(a):
        a = np.stack([a.real, a.imag], axis=-1)
    if jax.dtypes.itemsize_bits(a.dtype) < 8:  # int4, float4: exact in a byte-wide kind
        a = a.astype(np.int8 if jax.dtypes.issubdtype(a.dtype, np.integer) else np.float32)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32, 16: np.uint32}
    words = np.ascontiguousarray(a)[..., None].view(unsigned[a.dtype.itemsize])
    return words.astype(np.uint32).reshape((*shape, -1))


def _summed_over_processes(parts: list[np.ndarray]) -> list[np.ndarray]:
    """Each process's parts added up (mod 2**32) over the processes; collective."""
    if jax.process_count() == 1 or not parts:
        return parts
    from jax.experimental import multihost_utils

    flat = np.concatenate(parts).astype(np.uint32)
    total = np.asarray(multihost_utils.process_allgather(flat)).sum(axis=0, dtype=np.uint32)
    return np.split(total, np.cumsum([p.size for p in parts])[:-1])


def save_checkpoint(
    directory: str | os.PathLike[str],
    tree: Any,
    *,
    force: bool = False,
    metadata: dict[str, Any] | None = None,
) -> str:
    """Writes ``tree`` (sharded arrays included) to ``directory``, collectively and atomically.

    Every process calls it with the same directory, which all processes must see (one machine,
    or a shared file system / bucket across hosts); each writes the shards it holds (nothing is
    gathered onto one host), process 0 writes the metadata. The checkpoint is written into a
    temporary sibling and renamed when complete, so ``directory`` either holds a whole
    checkpoint or does not exist. A path that exists is refused, unless ``force=True`` and it
    holds a checkpoint and nothing else (or nothing): anything else there is the caller's,
    kept. ``force=True`` replaces the checkpoint only once the new one is whole: it is written
    beside it (``<directory>.replacing``), then swapped in, the old one kept as
    ``<directory>.replaced`` for the instant between the two renames (a save killed then leaves
    it there, and reading ``directory`` says to rename it back).
    ``metadata``: a JSON-able dict with string keys stored with it (read it back with
    :func:`checkpoint_metadata`). A checksum of each JAX-array leaf is stored too, and
    :func:`restore_checkpoint` checks the leaves it reads against them, so a damaged data file
    is an error, not other numbers. Orbax names a leaf by its keys joined with ``'.'`` (less a
    trailing ``'/'``): a tree with two leaves of one name (``{'a.b': x, 'a': {'b': y}}``,
    ``{'a': x, 'a/': y}``) is refused. Returns the absolute path once the write is complete.

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> path = save_checkpoint(tempfile.mkdtemp() + "/ckpt", {"w": jnp.ones(3)},
      ...                        metadata={"step": 3})
      >>> restore_checkpoint(path, {"w": jnp.zeros(3)})["w"].tolist(), checkpoint_metadata(path)
      ([1.0, 1.0, 1.0], {'step': 3})
    """
    import orbax.checkpoint as ocp

    # Orbax's own error for a donated array names no leaf and leaves its temporary folder.
    check_live(tree, "save_checkpoint: tree", "save the arrays the step returned")
    _check_savable(tree)
    _check_metadata(metadata)
    path = os.path.abspath(os.fspath(directory))
    _check_not_cut_short(path)
    _check_replaceable(path, force)
    # Over an existing checkpoint, orbax's force deleted it before writing: a save killed
    # meanwhile lost the only checkpoint. Written beside it, then swapped in.
    target = path + ".replacing" if force and os.path.exists(path) else path
    # Orbax keeps no checksum of the data: a damaged data file was read back as other numbers.
    sums = {**_leaf_checksums(tree), _METADATA_SUM: _metadata_sum(metadata or {})}
    stored = {**(metadata or {}), _CHECKSUMS_KEY: sums}
    with orbax_logs_held(about=target), ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(target, tree, force=force, custom_metadata=stored)
        checkpointer.wait_until_finished()
    if target != path:
        _on_process_0_then_all(lambda: _swap_in(target, path), "save_checkpoint: swapped in")
    return path


#: What a checkpoint folder of save_checkpoint holds (orbax's files), and nothing else.
_CHECKPOINT_ENTRIES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "commit_success.txt",
                       "manifest.ocdbt", "d", "array_metadatas", "descriptor")  # fmt: skip


def _check_replaceable(path: str, force: bool) -> None:
    """An existing ``path`` is replaced only with ``force`` and only if it holds a checkpoint
    and nothing else (or nothing), as are the folders the replacing passes through: orbax's
    force deleted any folder or file there, the user's files with it."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        what = "a link to nothing" if os.path.islink(path) else "a file"
        raise FileExistsError(
            f"save_checkpoint: {path} is {what}, not a checkpoint: give another directory."
        )
    held = sorted(os.listdir(path))
    extra = _not_a_checkpoints(held)
    checkpoint = any(f in held for f in (_METADATA_FILE, "_METADATA"))
    if checkpoint and not force:
        raise FileExistsError(
            f"save_checkpoint: {path} already holds a checkpoint: pass force=True to replace "
            "it, or give another directory."
        )
    if checkpoint and extra:
        raise FileExistsError(
            f"save_checkpoint: {path} holds a checkpoint and {', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}, which replacing it would delete: move "
            f"{'those' if len(extra) > 1 else 'that'} out first, or give another directory."
        )
    if held and not checkpoint:
        what = f"holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}"
        raise FileExistsError(
            f"save_checkpoint: {path} exists and is not a checkpoint ({what}): give a "
            "directory that does not exist yet (it is made)."
        )
    if not force:
        raise FileExistsError(
            f"save_checkpoint: {path} exists and is not a checkpoint (empty): give a directory "
            "that does not exist yet (it is made), or force=True to replace this empty one."
        )
    for p in (path + ".replacing", path + ".replaced"):  # the replacing passes through them
        # (orbax's force cannot remove a link at .replacing; .replaced's is removed alone)
        link = os.path.islink(p) and p.endswith(".replacing")
        if os.path.lexists(p) and (
            link or not os.path.isdir(p) or _not_a_checkpoints(os.listdir(p))
        ):
            raise FileExistsError(
                f"save_checkpoint: {p} is in the way of replacing {path} and is not a "
                "checkpoint folder of its own: move it away."
            )


def _not_a_checkpoints(entries: list[str]) -> list[str]:
    """Those of a folder's ``entries`` that no checkpoint holds (the user's), sorted."""
    return sorted(
        e for e in entries if e not in _CHECKPOINT_ENTRIES and not e.startswith("ocdbt.process_")
    )


def _check_savable(tree: Any) -> None:
    """Refuses what orbax refuses only once its write has begun: its writer thread then logged a
    traceback and left its temporary folder (a later save there could fail and hang the
    interpreter's exit). Arrays are written by TensorStore: a dtype it lacks is refused."""
    if tree is None or (isinstance(tree, Mapping | list | tuple) and not len(tree)):
        raise ValueError(
            f"save_checkpoint: the tree is {tree!r}, which orbax cannot save: give one holding "
            "at least one entry."
        )
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) == 1 and leaves[0] is tree:  # (not a node without leaves: orbax saves it)
        what = "array" if hasattr(tree, "shape") else "value"
        raise ValueError(
            f"save_checkpoint: the tree is a single {what}, which orbax saves only inside a "
            "tree: wrap it, e.g. {'x': x}."
        )
    stored_as: dict[str, str] = {}  # orbax names a leaf by its keys joined with '.'
    for p, x in jax.tree_util.tree_leaves_with_path(tree):
        key = jax.tree_util.keystr(p)
        name = ".".join(_path_names(p))
        name = name[:-1] if name.endswith("/") else name  # stored as without it: 'a/' is 'a'
        if name in stored_as:  # one would overwrite the other
            raise ValueError(
                f"save_checkpoint: tree{stored_as[name]} and tree{key} would be stored under "
                f"one name, '{name}' (orbax joins a leaf's keys with '.'): rename a key so "
                "that no two leaves spell the same name."
            )
        stored_as[name] = key
        dtype = (
            np.asarray(x).dtype if isinstance(x, bool | int | float) else getattr(x, "dtype", None)
        )
        if dtype is None or not _tensorstore_has(dtype):
            what = f"of dtype {dtype}" if dtype is not None else f"a {type(x).__name__}"
            raise ValueError(
                f"save_checkpoint: tree{key} is {what}, which orbax cannot save: a tree holds "
                "arrays and numbers (int, float, bool) of the dtypes TensorStore has; give other "
                "values as metadata= (JSON)."
            )
        if not np.size(x):
            raise ValueError(
                f"save_checkpoint: tree{key} has shape {x.shape}, no values, and orbax cannot "
                "save an empty array: leave it out of the tree."
            )


def _tensorstore_has(dtype: Any) -> bool:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # saved as its key data (uint32)
        return True
    import tensorstore

    try:
        tensorstore.dtype(np.dtype(dtype).name)
    except (TypeError, ValueError):
        return False
    return True


def _swap_in(new: str, path: str) -> None:
    """``new`` becomes ``path``; the old ``path`` is removed once ``new`` is in its place."""
    import shutil

    old = path + ".replaced"

    def remove(p: str) -> None:  # a link to a checkpoint goes, not what it links to
        if os.path.islink(p) or os.path.isfile(p):
            os.unlink(p)
        else:
            shutil.rmtree(p, ignore_errors=True)

    remove(old)
    os.rename(path, old)
    os.rename(new, path)
    remove(old)


def _check_not_cut_short(path: str) -> None:
    """A save with ``force`` killed between its two renames leaves the old checkpoint, whole,
    as ``<path>.replaced`` and no ``path``: said, not taken for a missing checkpoint."""
    old = path + ".replaced"
    if not os.path.exists(path) and os.path.isdir(old):
        raise FileNotFoundError(
            f"{path} is missing, and {old} holds the checkpoint it replaced: a save over it "
            f"was stopped between its two renames. Rename {old} back to {path} (the new "
            f"checkpoint, if whole, is {path}.replacing)."
        )


def _on_process_0_then_all(fn: Any, what: str) -> None:
    if jax.process_count() == 1:
        fn()
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(what + " (written)")
    if jax.process_index() == 0:
        fn()
    multihost_utils.sync_global_devices(what)


def _check_metadata(metadata: Any) -> None:
    """Refuses, on every process and before anything is written, metadata JSON cannot write:
    process 0 alone writes it, once the collective save has begun, so its TypeError (for a
    NumPy integer, say) left the other processes waiting in the save, and a temporary folder
    behind."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        what = type(metadata).__name__
        raise ValueError(f"save_checkpoint: metadata must be a dict, not {what}.")
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"save_checkpoint: metadata is not JSON ({e}); use Python numbers, strings, lists and "
            "dicts (x.item() or x.tolist() for NumPy and JAX values)."
        ) from None
    # JSON writes {7: 'x'} as {"7": "x"}: orbax refused a top-level one once it had deleted
    # the checkpoint it replaced, and a nested one came back as another key.
    bad, key = _non_string_key(metadata)
    if bad:
        raise ValueError(
            f"save_checkpoint: metadata key {key!r} is not a string (JSON keys are); use "
            f"str keys, e.g. {str(key)!r}."
        )
    if _CHECKSUMS_KEY in metadata:
        raise ValueError(
            f"save_checkpoint: metadata key {_CHECKSUMS_KEY!r} is the one the checkpoint keeps "
            "its checksums under; name yours otherwise."
        )


def _non_string_key(tree: Any) -> tuple[bool, Any]:
    """``(True, key)`` for the first dict key in ``tree`` (dicts and lists within) that is not
    a str (``None`` included), else ``(False, None)``."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(
        tree, (list, tuple)) else ()  # fmt: skip
    for key, value in items:
        if isinstance(tree, dict) and not isinstance(key, str):
            return True, key
        found = _non_string_key(value)
        if found[0]:
            return found
    return False, None


#: The loggers orbax's records reach: its own (absl), and asyncio's "Task exception was never
#: retrieved" for a write task of its event loop that failed.
_ORBAX_LOGGERS = ("absl", "asyncio")


def _from_orbax(record: logging.LogRecord) -> bool:
    if record.name == "asyncio":
        return f"{os.sep}orbax{os.sep}" in record.getMessage()
    return f"{os.sep}orbax{os.sep}" in record.pathname


class _HoldOrbaxLogs(logging.Filter):
    """Holds the records of ``level`` and above that orbax (its threads too) logs meanwhile."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level, self.held = level, []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level and _from_orbax(record):
            self.held.append(record)
            return False
        return True


class _DropLateOrbaxErrors(logging.Filter):
    """Drops the error records orbax's threads log after a write already failed and raised
    (they name a path of that write): the error raised said it, and they came after the
    program's own one-line report of it."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not self.failed or not _from_orbax(record):
            return True
        message = record.getMessage()
        return not any(path in message for path in self.failed)


_LATE = _DropLateOrbaxErrors()
for _name in _ORBAX_LOGGERS:
    logging.getLogger(_name).addFilter(_LATE)


@contextlib.contextmanager
def orbax_logs_held(level: int = logging.ERROR, about: str | None = None) -> Iterator[None]:
    """Orbax's log records of ``level`` and above: dropped if the block raises, passed on if not.

    A failed write (a full disk) makes orbax log the same error with a traceback from each of
    its threads, hundreds of lines, before raising it once; reading a damaged checkpoint warns
    before it raises. The error raised says it all. ``about``: the path written; error records
    naming it that orbax's threads log after the block raised are dropped too.
    """
    loggers, hold = [logging.getLogger(name) for name in _ORBAX_LOGGERS], _HoldOrbaxLogs(level)
    for logger in loggers:  # first: a block inside another holds its own records
        logger.filters.insert(0, hold)
    try:
        yield
    except BaseException:
        if about is not None:
            _LATE.failed.add(about)
        raise
    finally:
        for logger in loggers:
            logger.removeFilter(hold)
    for record in hold.held:  # reached only when the block succeeded
        logging.getLogger(record.name).handle(record)


def checkpoint_metadata(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``metadata`` dict given to :func:`save_checkpoint` (``{}`` if none was given).

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> checkpoint_metadata(save_checkpoint(tempfile.mkdtemp() + "/c", {"w": jnp.ones(2)}))
      {}
    """

    path = os.path.abspath(os.fspath(directory))
    _check_not_cut_short(path)
    _check_is_checkpoint(path, "checkpoint_metadata")  # (orbax logged it and read {})
    _refuse_damaged_metadata_file(path, "the metadata saved with it cannot be read")
    stored = dict(stored_metadata(path).custom_metadata or {})
    sums = stored.pop(_CHECKSUMS_KEY, None)
    if isinstance(sums, dict) and _METADATA_SUM in sums:  # (older checkpoints have none)
        if sums[_METADATA_SUM] != _metadata_sum(stored):
            raise DamagedCheckpoint(path, "its metadata does not match the checksum saved")
    return stored


def _check_is_checkpoint(path: str, who: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{who}: no checkpoint at {path}.")
    tree_here = os.path.exists(os.path.join(path, "_METADATA"))
    items = sorted(d for d in os.listdir(path) if os.path.isfile(f"{path}/{d}/_METADATA"))
    whole = [d for d in items if os.path.isfile(f"{path}/{d}/{_METADATA_FILE}")]
    if whole and not tree_here:
        raise FileNotFoundError(
            f"{who}: {path} holds no checkpoint, but checkpoints in its folders "
            f"({', '.join(whole[:3])}{', ...' if len(whole) > 3 else ''}); give one of those."
        )
    if items and not tree_here:
        raise FileNotFoundError(
            f"{who}: {path} holds orbax items in folders of their own ({', '.join(items)}), as "
            "a CheckpointManager step does, not one save_checkpoint checkpoint; read those "
            "with orbax."
        )
    if _item_of_a_step(path):
        raise FileNotFoundError(
            f"{who}: {path} is an item of the orbax CheckpointManager step "
            f"{os.path.dirname(path)}, not a save_checkpoint checkpoint; read it with orbax."
        )
    if not any(os.path.exists(os.path.join(path, f)) for f in (_METADATA_FILE, "_METADATA")):
        raise FileNotFoundError(
            f"{who}: {path} holds no checkpoint (no {_METADATA_FILE} or _METADATA in it); "
            "give the checkpoint's own directory."
        )


def _item_of_a_step(path: str) -> bool:
    """An orbax CheckpointManager step's item folder: its _METADATA here, the step's
    _CHECKPOINT_METADATA in the folder above (a save_checkpoint checkpoint has both here)."""
    here = os.path.exists(os.path.join(path, _METADATA_FILE))
    above = os.path.exists(os.path.join(os.path.dirname(path), _METADATA_FILE))
    return not here and above and os.path.exists(os.path.join(path, "_METADATA"))


def _refuse_damaged_metadata_file(path: str, so: str) -> None:
    """:class:`DamagedCheckpoint` if the metadata file cannot be read (orbax only logs it)."""
    try:
        with open(os.path.join(path, _METADATA_FILE)) as f:
            if isinstance(json.load(f), dict):
                return
            damage = "not a JSON object"
    except (OSError, ValueError) as e:
        damage = type(e).__name__
    what = f"its metadata file {_METADATA_FILE} is missing or damaged ({damage}), so {so}"
    raise DamagedCheckpoint(path, what)


def stored_metadata(path: str) -> Any:
    """Orbax's metadata of the checkpoint at ``path`` (its leaves' shapes and dtypes, and the
    ``metadata`` dict). Orbax also reads each leaf's saved sharding from the checkpoint's
    ``_sharding`` file, and one damaged there but still valid JSON (a key's name changed by a
    flipped bit) raised a KeyError, so an intact checkpoint could not be read. A restore into
    given shardings never needs that file: it is then read through a view of the checkpoint
    without it (links to the other files; nothing is copied or changed). Where that fails too
    (another file is damaged, the view cannot be made), the first error stands. Damage that
    is not valid JSON, orbax only logs, leaving out the leaves' metadata (so no shape or dtype
    could be checked): the view is read then too, and that warning is dropped if it works."""
    import orbax.checkpoint as ocp

    sharding_file = os.path.isfile(os.path.join(path, _SHARDING_FILE))
    failed: Exception | None = None
    try:
        with orbax_logs_held(logging.WARNING), ocp.StandardCheckpointer() as checkpointer:
            found = checkpointer.metadata(path)
            if found.item_metadata is None and sharding_file:
                raise _NoLeafMetadata(found)  # its warning held back, dropped by the raise
            return found
    except _NoLeafMetadata as e:
        found = e.args[0]
    except Exception as e:
        if not sharding_file:
            raise _as_damage(path, e) from e
        found, failed = None, e
    try:  # (its warnings would name the view, gone by then)
        with orbax_logs_held(logging.WARNING), _without_sharding_file(path) as view:
            with ocp.StandardCheckpointer() as checkpointer:
                viewed = checkpointer.metadata(view)
            if viewed.item_metadata is None:
                raise _NoLeafMetadata(viewed)
    except Exception:
        viewed = None
    if viewed is not None and viewed.item_metadata is not None:
        return viewed
    if failed is not None:
        raise _as_damage(path, failed) from failed  # naming the checkpoint, not the view
    return found


# What orbax and TensorStore raise on reading a damaged file (a byte flipped, a file cut
# short or deleted), seen in sweeps over every file of a checkpoint; other errors are the
# caller's (a like whose sharding does not divide its shape, a partial tree of another type).
_DAMAGE_TYPES = (KeyError, AttributeError, UnicodeDecodeError, json.JSONDecodeError, OSError)
_DAMAGE_WORDS = ("DATA_LOSS", "NOT_FOUND", "OUT_OF_RANGE", "Encountered error while reading",
                 'Error opening "', "unknown key")  # fmt: skip


def _as_damage(path: str, e: Exception) -> Exception:
    """Orbax's or TensorStore's error on reading a damaged file (a KeyError naming a JSON
    field, ``DATA_LOSS``, a 60-line TensorStore spec) as one :class:`DamagedCheckpoint` line
    naming the checkpoint; ``e`` itself where it says something else."""
    said = str(e)
    damage = isinstance(e, _DAMAGE_TYPES) or any(word in said for word in _DAMAGE_WORDS)
    if isinstance(e, (DamagedCheckpoint, PermissionError)) or not damage or "PERMISSION" in said:
        return e
    first = (str(e).strip().splitlines() or [""])[0]
    first = first if len(first) <= 120 else first[:117] + "..."
    return DamagedCheckpoint(path, f"it cannot be read ({type(e).__name__}: {first})")


class _NoLeafMetadata(Exception):
    """Orbax read a checkpoint's metadata without its leaves' (``args[0]``: what it read)."""


_SHARDING_FILE = "_sharding"  # orbax's record of the shardings a checkpoint was written with
_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax's, holding save_checkpoint's metadata


@contextlib.contextmanager
def _without_sharding_file(path: str) -> Iterator[str]:
    import shutil
    import tempfile

    view = tempfile.mkdtemp(prefix="checkpoint-view-")
    try:
        for name in os.listdir(path):
            if name != _SHARDING_FILE:
                os.symlink(os.path.join(path, name), os.path.join(view, name))
        yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)  # the links only


def restore_checkpoint(
    directory: str | os.PathLike[str], like: Any, *, partial: bool = False
) -> Any:
    """Reads a checkpoint of :func:`save_checkpoint` straight into the shardings of ``like``.

    ``like`` is a tree of JAX arrays or ``jax.ShapeDtypeStruct`` (with ``sharding=``) of the
    same structure; each process reads only the shards it holds. The checkpoint may come from
    a run with another number of processes or devices. Collective: every process calls it. A
    leaf of another shape (another member count) or dtype than the checkpoint's is one
    ``ValueError`` (a PRNG key leaf is read as the like's kind, a typed key or its key data,
    whichever was saved; a typed key of another implementation is refused), as are a tree of
    another structure and a float64 or int64 JAX array saved with x64 on, read with it off
    (NumPy and Python values read as JAX narrows them then); a leaf read that does not match
    the checksum saved with it (a damaged file) is :class:`DamagedCheckpoint`, as are a
    missing or damaged metadata file, which holds the checksums, and a file orbax cannot read.
    ``partial=True`` reads only the leaves ``like`` has (the params of a checkpoint that also
    holds the optimizer state, for inference). NumPy leaves carry no placement: a run with one
    device (in all) reads them onto it; with several, they are refused (place ``like`` first:
    arrays from ``ens.init`` / ``step.init``, or ``jax.device_put``).

    Example (members written from one mesh, read back onto the same devices):
      >>> import tempfile, jax, numpy as np, ensemble
      >>> n = jax.device_count()
      >>> w = ensemble.shard_members(np.arange(2.0 * n).reshape(n, 2), ensemble.make_mesh(n), n)
      >>> path = save_checkpoint(tempfile.mkdtemp() + "/c", {"w": w, "opt": w + 1})
      >>> back = restore_checkpoint(path, {"w": w, "opt": w})
      >>> back["w"].sharding == w.sharding, bool((back["w"] == w).all())
      (True, True)
      >>> list(restore_checkpoint(path, {"w": w}, partial=True))  # the params alone
      ['w']
    """

    path = os.path.abspath(os.fspath(directory))
    _check_not_cut_short(path)
    _check_is_checkpoint(path, "restore_checkpoint")  # a typo is not damage
    # (orbax reads the arrays without it, and the checksums are in it)
    _refuse_damaged_metadata_file(
        path, "what is read cannot be checked against the checksums saved there"
    )
    like = _abstract(path, like)
    metadata = stored_metadata(path)
    stored = metadata.item_metadata
    sums = (metadata.custom_metadata or {}).get(_CHECKSUMS_KEY, _NONE_KEPT)
    _check_shapes(path, stored, like, sums)
    out = _read(path, stored, like) if not partial else _read_partially(path, stored, like)
    _check_sums(path, out, sums)
    return jax.tree_util.tree_map_with_path(
        lambda p, x, want: _key_kind_as_like(path, p, x, want), out, like
    )


def _key_kind_as_like(path: str, p: tuple, x: jax.Array, like: jax.ShapeDtypeStruct) -> jax.Array:
    """Orbax returns a PRNG key leaf as it was saved, a typed key or its raw key data, whatever
    ``like`` holds (the two have the same data): given back as the like's kind. A typed key of
    another implementation with data of the same shape is refused, as another dtype is."""
    typed = jax.dtypes.issubdtype(like.dtype, jax.dtypes.prng_key)
    if typed and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) and x.dtype != like.dtype:
        raise ValueError(
            f"restore_checkpoint({path}): like{jax.tree_util.keystr(p)} is a {like.dtype} key, "
            f"the checkpoint's a {x.dtype} key (another PRNG implementation): restore into a "
            "like of the checkpoint's, jax.random.key(seed, impl=...)."
        )
    if typed == jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    if typed:  # (the impl read off a key of the like's dtype)
        return jax.random.wrap_key_data(x, impl=jax.random.key_impl(jnp.empty((), like.dtype)))
    return jax.random.key_data(x)


def _read(path: str, stored: Any, like: Any) -> Any:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        try:
            return checkpointer.restore(path, like)
        except Exception as e:  # orbax's: the whole metadata tree, and a flag we lack
            if "tree structures do not match" not in str(e):
                raise _as_damage(path, e) from e
            raise ValueError(_structure_mismatch(path, stored, like)) from None


def _read_partially(path: str, stored: Any, like: Any) -> Any:
    import orbax.checkpoint as ocp

    restore = ocp.checkpoint_utils.construct_restore_args(like)
    with ocp.PyTreeCheckpointer() as checkpointer:
        args = ocp.args.PyTreeRestore(item=like, restore_args=restore, partial_restore=True)
        try:
            out = checkpointer.restore(path, args=args)
        except Exception as e:
            raise _as_damage(path, e) from e
    # A leaf the checkpoint lacks comes back as the shape struct given: refused, not returned.
    leaves = jax.tree_util.tree_leaves_with_path(out)
    absent = [p for p, x in leaves if not isinstance(x, jax.Array)]
    if absent:
        raise ValueError(
            f"restore_checkpoint({path}, partial=True): like{jax.tree_util.keystr(absent[0])} "
            f"(of {len(absent)} such leaves) is not in the checkpoint, which holds "
            f"{_some(_leaf_names(stored), 6)}."
        )
    return out


_NONE_KEPT = object()  # a checkpoint saved before checksums were kept
_METADATA_SUM = "metadata"  # the checksum record's entry for the metadata (leaves: JSON lists)


def _metadata_sum(metadata: dict[str, Any]) -> int:
    import zlib

    return zlib.crc32(json.dumps(metadata, sort_keys=True).encode())


def _check_sums(path: str, out: Any, saved: Any) -> None:
    """The leaves read against the checksums saved with them."""
    if saved is _NONE_KEPT:
        return
    if not isinstance(saved, dict):
        raise DamagedCheckpoint(path, f"its checksum record is damaged ({type(saved).__name__})")
    bad = [name for name, s in _leaf_checksums(out).items() if saved.get(name, s) != s]
    if bad:
        names = ["/".join(json.loads(name)) for name in bad]
        more = f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else ""
        raise DamagedCheckpoint(
            path, f"leaf {names[0]}{more} does not match the checksum saved with it", names
        )


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files are damaged: leaves or metadata, as read, that do not match the
    checksums saved with them, checksums that cannot be read, or a file orbax cannot read.
    ``what``: which, in words; ``leaves``: the names of the leaves that do not match."""

    def __init__(self, path: str, what: str, leaves: list[str] | None = None) -> None:
        super().__init__(
            f"checkpoint {path}: {what}: the checkpoint's files are damaged. Restore an "
            "earlier checkpoint."
        )
        self.what, self.leaves = what, leaves or []


def _abstract(path: str, like: Any) -> Any:
    """``like`` as ShapeDtypeStructs with shardings (see :func:`restore_checkpoint`)."""
    one_device = jax.device_count() == 1
    unplaced = []

    def abstract(p: Any, x: Any) -> jax.ShapeDtypeStruct:
        sharding = getattr(x, "sharding", None)
        if sharding is None and one_device:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        elif sharding is None:
            unplaced.append(jax.tree_util.keystr(p))
        dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)  # (typed keys: theirs)
        return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)

    like = jax.tree_util.tree_map_with_path(abstract, like)
    if unplaced:
        raise ValueError(
            f"restore_checkpoint({path}): like{unplaced[0]} (of {len(unplaced)} such leaves) has "
            f"no placement on the run's {jax.device_count()} devices: pass arrays already "
            "placed (from ens.init / step.init, or jax.device_put) or ShapeDtypeStructs with "
            "sharding=."
        )
    return like


def _leaf_names(tree: Any) -> set[str]:
    return {
        "/".join(_path_names(p))
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if getattr(x, "shape", None) is not None
    }


def _some(names: set[str], k: int = 3) -> str:
    return ", ".join(sorted(names)[:k]) + (", ..." if len(names) > k else "")


def _structure_mismatch(path: str, stored: Any, like: Any) -> str:
    """One line for a ``like`` whose leaves are not the checkpoint's."""
    have, want = _leaf_names(stored), _leaf_names(like)
    if want < have:
        return (
            f"restore_checkpoint({path}): like has {len(want)} of the checkpoint's {len(have)} "
            f"leaves (not {_some(have - want)}); pass partial=True to read only those like has."
        )
    named = f" (like has {_some(want - have)})" if want - have else ""
    return (
        f"restore_checkpoint({path}): like's tree is not the checkpoint's{named}; the "
        f"checkpoint holds {_some(have, 6)}."
    )


def _check_shapes(path: str, stored: Any, like: Any, sums: Any) -> None:
    """One line for a leaf whose shape differs from the checkpoint's (orbax's own error
    suggests padding or truncating it, which would silently drop or invent members), or whose
    dtype does (orbax casts to the like's dtype without a word: float32 into bfloat16).
    ``sums``: the checkpoint's checksum record (which leaves have checksums)."""
    saved = {
        _path_names(p): (tuple(m.shape), getattr(m, "dtype", "?"))
        for p, m in jax.tree_util.tree_leaves_with_path(stored)
        if getattr(m, "shape", None) is not None
    }
    for p, x in jax.tree_util.tree_leaves_with_path(like):
        key, want, dtype = jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype)
        is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        if is_key:  # stored as its key data
            data = jax.eval_shape(jax.random.key_data, x)
            want, dtype = data.shape, str(data.dtype)
        have, have_dtype = saved.get(_path_names(p), (want, dtype))
        summed = isinstance(sums, dict) and json.dumps(_path_names(p)) in sums
        _check_dtype(f"restore_checkpoint({path}): ", key, dtype, str(have_dtype), summed)
        if have == want:
            continue
        if is_key:
            raise ValueError(
                f"restore_checkpoint({path}): like{key} is a {x.dtype} key of shape "
                f"{tuple(x.shape)} (key data {want}), the checkpoint's key data {have}: restore "
                "into a like of the checkpoint's PRNG implementation and shape."
            )
        members = ""
        if len(have) == len(want) and have[1:] == want[1:]:
            members = (
                f": the checkpoint holds {have[0]} members and like {want[0]}; restore into a "
                f"like of {have[0]} members (ensemble.build(model, {have[0]}))"
            )
        raise ValueError(
            f"restore_checkpoint({path}): like{key} has shape {want}, the checkpoint "
            f"{have}{members}."
        )


def _check_dtype(who: str, key: str, dtype: str, have: str, summed: bool) -> None:
    """The like's ``dtype`` against the checkpoint's, ``have``. Without x64, orbax reads a
    64-bit leaf as its 32-bit kind, whose bits cannot match the leaf's checksum (``summed``:
    it has one, as a JAX array, saved with x64 on, has); a leaf without one (a NumPy or Python
    value, any leaf of a checkpoint from before checksums) narrows as JAX narrows any such
    value, into a like of either dtype."""
    narrowed = str(jax.dtypes.canonicalize_dtype(have)) if have != "?" else have
    if narrowed != have and summed:
        raise ValueError(
            f"{who}like{key}: the checkpoint's leaf is {have}, saved with x64 on: read it with "
            "x64 on too (JAX_ENABLE_X64=1, or "
            "jax.config.update('jax_enable_x64', True) before using JAX), then cast."
        )
    if dtype not in (have, narrowed):
        raise ValueError(
            f"{who}like{key} is {dtype}, the checkpoint {have}: restore into a like of the "
            "checkpoint's dtype, then cast (orbax would cast it silently)."
        )


def _path_names(path: tuple) -> tuple[str, ...]:
    """A leaf's path as names, however each level is keyed: the checkpoint's metadata keys an
    ``nnx.State``'s Variable values ``['value']`` where the State itself has ``.value``."""
    names = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return tuple(str(n) for n in names)


# -- internals -------------------------------------------------------------------------------


_COMPARISONS = itertools.count()  # every process compares in the same order: one key each


#: ``jax.config`` options that change what a program computes (its dtypes, random streams,
#: matmul precision, type promotion): every process of a run needs the same ones, or each
#: computes its own members another way (x64 on one process: half the members in float64).
NUMERIC_JAX_SETTINGS = (
    "jax_enable_x64",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_random_seed_offset",
    "jax_default_matmul_precision",
    "jax_numpy_dtype_promotion",
    "jax_softmax_custom_jvp",
)


def numeric_jax_settings() -> dict[str, str]:
    """The :data:`NUMERIC_JAX_SETTINGS` as in effect here, for :func:`settings_that_differ`.

    Example:
      >>> sorted(numeric_jax_settings())[:2]
      ['jax_default_matmul_precision', 'jax_default_prng_impl']
    """
    values = jax.config.values
    found = {name: getattr(jax.config, name, values.get(name)) for name in NUMERIC_JAX_SETTINGS}
    precision = found.get("jax_default_matmul_precision")
    with contextlib.suppress(ValueError):  # spellings of one precision: float32 is highest
        found["jax_default_matmul_precision"] = jax.lax.Precision(precision or "default")
    return {name: str(value) for name, value in found.items() if name in values}


def settings_that_differ(fields: dict[str, Any], timeout_s: float = 300.0) -> list[str]:
    """The names in ``fields`` whose values differ between the processes of this run.

    Compared through the coordinator's key-value store, so before any collective between
    devices: processes that disagree on their devices fail such a collective or wait in it
    forever (where JAX's store cannot be reached, its internals having changed, through a
    collective between devices instead). ``[]`` for a single process. Collective: every
    process calls it, in the same order, with the same names.

    Example (one process: nothing to differ from):
      >>> settings_that_differ({"lr": 3e-4, "data": "/scratch/set-a"})
      []
    """
    try:
        from jax._src import distributed as jax_distributed

        state = jax_distributed.global_state
        client, count, me = state.client, state.num_processes, state.process_id
        if client is None or not count or count == 1:  # not joined to others: one process
            return []
        put, get = client.key_value_set, client.blocking_key_value_get
        barrier = client.wait_at_barrier
    except Exception:  # pragma: no cover - depends on JAX internals
        return _differ_on_devices(fields)
    key, wait_ms = f"ensemble/settings/{next(_COMPARISONS)}", int(timeout_s * 1000)
    mine = {k: _comparable(v) for k, v in fields.items()}
    put(f"{key}/{me}", json.dumps(mine))
    differ: set[str] = set()
    for other in range(count):
        try:
            theirs = json.loads(get(f"{key}/{other}", wait_ms))
        except Exception as e:  # JAX's timeout error, or the coordinator gone
            reason = (str(e).strip().splitlines() or [""])[0]
            raise RuntimeError(
                f"could not read the settings of process {other} within {timeout_s:.0f} s: it "
                f"stopped or never came, or the coordinator (on process 0) stopped [{reason}]"
            ) from None
        differ |= {k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)}
    # Every process has read every other's before any acts on the result: process 0 (which
    # holds the coordinator) stopping at once left the others with a gRPC abort. The barrier's
    # own answer may then be lost (process 0 passed it and stopped): this process has read
    # every value already, so its result stands.
    with contextlib.suppress(Exception):
        barrier(f"{key}/read", wait_ms)
    return sorted(differ)


def leave_together() -> None:
    """Every process of the run leaves it together, for a refusal every one of them reached
    (:func:`settings_that_differ` gives each the same answer): each waits at JAX's shutdown
    barrier for the others, then process 0 stops the coordinator. A process that exited alone
    took the coordinator with it (process 0) and a peer still printing its own refusal aborted
    in gRPC (exit 134). A no-op for a single process; JAX is left unjoined."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def _comparable(value: Any) -> str:
    """``value`` as JSON; arrays (of NumPy, JAX, in lists and dicts too) by dtype, shape and a
    digest of every element: ``str()`` of one of over 1,000 elements leaves its middle out, so
    arrays that differed there compared equal. Other objects JSON cannot write: ``str()``."""

    def other(x: Any) -> Any:
        if hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "__array__"):
            with contextlib.suppress(Exception):  # (typed PRNG keys: by str below)
                a = np.ascontiguousarray(np.asarray(x))
                digest = hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()
                return {"dtype": str(a.dtype), "shape": list(a.shape), "sha256": digest}
        return str(x)

    return json.dumps(value, sort_keys=True, default=other)


def _differ_on_devices(fields: dict[str, Any]) -> list[str]:  # pragma: no cover
    """:func:`settings_that_differ` through an allgather of one checksum per name."""
    import zlib

    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return []
    names = sorted(fields)
    mine = [zlib.crc32(_comparable(fields[k]).encode()) for k in names]
    every = np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.uint32)))
    return sorted({names[j] for row in every for j in np.flatnonzero(row != every[0])})


def _info() -> ProcessInfo:
    from jax._src import distributed as jax_distributed

    return ProcessInfo(
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        coordinator_address=jax_distributed.global_state.coordinator_address,
        local_device_count=jax.local_device_count(),
        device_count=jax.device_count(),
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} must be an integer.") from None


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _cluster_detected() -> bool:
    """Whether jax.distributed would find its settings in a cluster environment on its own."""
    try:
        from jax._src.clusters import ClusterEnv

        return any(
            not env.opt_in_only_method and env.is_env_present() for env in ClusterEnv._cluster_types
        )
    except Exception:  # a private JAX API moved: look for the usual variables instead
        markers = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "PMIX_RANK", "JOB_COMPLETION_INDEX")
        return any(m in os.environ for m in markers)


def _fail_fast_on_uncaught_exceptions() -> None:
    """An uncaught exception ends this process now, instead of after the shutdown barrier.

    At exit, JAX waits (up to ``shutdown_timeout_seconds``) until every process reaches the
    shutdown barrier. A process that crashed would sit there while the others keep running (or
    wait for it in a collective): seen as a 2.5 minute stall with the default timeouts. Exiting
    at once lets the launcher stop the rest, and other hosts notice the missing heartbeats.
    """
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        rank = jax.process_index()
        sys.stderr.write(
            f"ensemble.distributed: process {rank} failed with {exc_type.__name__}; exiting now "
            "without waiting for the other processes (they stop when they notice).\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

    sys.excepthook = hook


def _check_coordinator_port(address: str | None) -> None:
    """Process 0 binds the coordinator's port: a taken one made JAX 0.10.2 crash the process
    (a segfault, or "Failed to start RPC server") and left the others waiting to abort."""
    from ensemble.launch import port_in_use

    if not address or ":" not in address:
        return
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    local = "0.0.0.0" if not _is_loopback(address) else "127.0.0.1" if host == "localhost" else host
    if port.isdigit() and ":" not in local and port_in_use(int(port), local):
        raise OSError(
            f"the coordinator's port {port} is already in use on this machine (another run's "
            "coordinator?); nothing was started. Give process 0's address another port."
        )


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _gloo_on_loopback() -> None:
    """Makes gloo (CPU collectives between processes) listen on 127.0.0.1 only.

    By default gloo binds the address the host name resolves to, which on many machines is a
    public interface. For a run on one machine we register a CPU backend whose gloo binds
    loopback. Falls back to JAX's default (with a log line) if JAX's internals differ.
    """
    try:
        from jax._src import distributed as jax_distributed
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        def make_cpu_client():
            collectives = _jax.make_gloo_tcp_collectives(
                distributed_client=jax_distributed.global_state.client, hostname="127.0.0.1"
            )
            return xla_bridge.make_cpu_client(collectives=collectives)

        xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)
    except Exception as e:  # pragma: no cover - depends on JAX internals
        logger.warning("could not pin gloo to loopback (%s); it binds JAX's default address", e)
