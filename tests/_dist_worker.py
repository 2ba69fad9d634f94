r"""One process of the multi-process ensemble test (run by tests/test_distributed.py).

Alone it is a 1-process run; under ``python -m ensemble.launch -n 2 --devices-per-process 2``
it is one of two processes sharing a 4-device mesh. Either way it trains the same 4-member MLP
ensemble on the same per-member data, and writes ``OUT/params.npz`` (process 0) and
``OUT/report_<rank>.json`` (every process: placement, memory, sockets) for the test to compare.

  python tests/_dist_worker.py --out /tmp/one                       # JAX_NUM_CPU_DEVICES=4
  python -m ensemble.launch -n 2 --devices-per-process 2 -- python tests/_dist_worker.py \
      --out /tmp/two
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ensemble import _distributed as distributed

N_MEMBERS = 4
BATCH = 16
FEATURES = 3


def member_data(i: int, step: int):
    """Member i's batch at a step, made from (i, step) alone, so any process can make it."""
    import numpy as np

    rng = np.random.default_rng(1000 * i + step)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True) * (1 + i)).astype(np.float32)
    return x, y


def listening_addresses() -> list[str]:
    """Local addresses of the TCP sockets this process listens on (from /proc, Linux only)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local, state, inode = parts[1], parts[3], parts[9]
            if state == "0A" and inode in inodes:  # 0A = LISTEN
                out.append(_decode_address(local, width))
    return out


def _decode_address(text: str, width: int) -> str:
    import ipaddress

    hex_ip, hex_port = text.split(":")
    raw = bytes.fromhex(hex_ip)
    # /proc stores each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw) if width == 8 else ipaddress.IPv6Address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return f"{ip}:{int(hex_port, 16)}"


def train_nnx(steps: int, local: list[int]):
    """The same ensemble through the NNX API: returns host params and this process's shards."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import ensemble

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.hidden = nnx.Linear(FEATURES, 32, rngs=rngs)
            self.out = nnx.Linear(32, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.tanh(self.hidden(x)))

    ens = ensemble.build(MLP, N_MEMBERS)
    optimizer = ensemble.nnx_optimizer(ens, optax.adam(1e-2))
    step = ensemble.nnx_train_step(lambda m, x, y: ((m(x) - y) ** 2).mean(), per_member_batch=True)
    for t in range(steps):
        xs, ys = zip(*(member_data(i, t % 8) for i in local))
        x, y = distributed.member_batch_from_local((np.stack(xs), np.stack(ys)), ens.mesh, ens.n)
        step(ens, optimizer, x, y)
    state = nnx.state(ens, nnx.Param)
    shards = {
        jax.tree_util.keystr(path): sorted(
            [s.device.id, s.index[0].start, s.index[0].stop] for s in leaf.addressable_shards
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(state)
    }
    host = distributed.gather_metrics_to_host(state)
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(host)}
    return flat, shards


def train_other_layouts(steps: int) -> tuple[dict, dict]:
    """n = 2 (each member spans 2 devices, on one process) and n = 8 (2 members per device)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import ensemble

    model = nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(1)])
    flat, members = {}, {}
    for n in (2, 8):
        ens = ensemble.build(model, n)
        params = ens.init(jax.random.key(1), jnp.zeros((BATCH, FEATURES)))["params"]
        step = ensemble.train_step(
            lambda p, x, y: jnp.mean((model.apply({"params": p}, x) - y) ** 2),
            optax.adam(1e-2),
            n=n,
            mesh=ens.mesh,
            per_member_batch=True,
        )
        opt_state = step.init(params)
        local = distributed.process_local_members(ens.mesh, n)
        for t in range(steps):
            xs, ys = zip(*(member_data(i, t) for i in local))
            x, y = distributed.member_batch_from_local((np.stack(xs), np.stack(ys)), ens.mesh, n)
            params, opt_state, _ = step(params, opt_state, x, y)
        ensemble.assert_member_placement((params, opt_state), ens.mesh, n)
        host = distributed.gather_metrics_to_host(params)
        for path, v in jax.tree_util.tree_leaves_with_path(host):
            flat[f"n{n}{jax.tree_util.keystr(path)}"] = v
        members[n] = local
    return flat, members


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--restore", default=None, help="a checkpoint to compare with")
    parser.add_argument("--forever", action="store_true", help="keep stepping (failure tests)")
    parser.add_argument("--die-rank", type=int, default=None)
    parser.add_argument("--die-after", type=int, default=2)
    parser.add_argument("--die-how", choices=("kill", "raise", "exit"), default="kill")
    parser.add_argument(
        "--idle-rank", type=int, default=None, help="this rank sleeps (no collective) after"
    )
    parser.add_argument("--heartbeat", type=int, default=10, help="heartbeat timeout, seconds")
    return parser.parse_args()


def _fail_on_purpose(args: argparse.Namespace, rank: int, t: int, idle_flag: str) -> None:
    """The failure tests' faults: a rank that dies (SIGKILL or raise) or goes idle after step t."""
    if args.die_rank == rank and t == args.die_after:
        if args.idle_rank is not None:  # die only once the idle rank is out of collectives
            deadline = time.time() + 60
            while not os.path.exists(idle_flag) and time.time() < deadline:
                time.sleep(0.05)
        print(f"rank {rank} dying now at {time.time():.3f}", flush=True)
        if args.die_how == "raise":
            raise RuntimeError(f"rank {rank} fails on purpose")
        if args.die_how == "exit":  # as a command line that caught its error ends
            from ensemble._exit import exit_process

            exit_process(3)
        os.kill(os.getpid(), signal.SIGKILL)
    if args.idle_rank == rank and t == args.die_after:
        # Far from any collective: only JAX's heartbeat check can notice a dead peer.
        print(f"rank {rank} idle from {time.time():.3f}", flush=True)
        open(idle_flag, "w").close()
        time.sleep(120)


def _checkpoint_checks(args: argparse.Namespace, params) -> tuple[bool, float | None]:
    """Own round trip equal shard by shard; max |diff| to a checkpoint of another process count."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    ckpt = distributed.save_checkpoint(os.path.join(args.out, "ckpt"), params, force=True)
    restored = distributed.restore_checkpoint(ckpt, params)
    same = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for ra, rb in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(params))
        for a, b in zip(ra.addressable_shards, rb.addressable_shards)
    )
    other = None
    if args.restore:  # a checkpoint written by a run with another process count
        theirs = distributed.restore_checkpoint(args.restore, params)
        diff = jax.tree_util.tree_map(lambda a, b: jnp.max(jnp.abs(a - b)), theirs, params)
        other = float(max(distributed.gather_metrics_to_host(jax.tree_util.tree_leaves(diff))))
    return same, other


def _shard_table(params) -> dict:
    """Per leaf: [device, first member, end member, shard shape] of this process's shards."""
    import jax

    return {
        jax.tree_util.keystr(path): [
            [s.device.id, s.index[0].start, s.index[0].stop, list(s.data.shape)]
            for s in leaf.addressable_shards
        ]
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }


def _placement_report(info, local: list[int], params) -> dict:
    import jax

    return {
        "rank": info.process_id,
        "num_processes": info.num_processes,
        "device_count": info.device_count,
        "local_devices": [d.id for d in jax.local_devices()],
        "local_members": local,
        "shards": _shard_table(params),
        "fully_addressable": [
            leaf.is_fully_addressable for leaf in jax.tree_util.tree_leaves(params)
        ],
    }


def _save_params(out: str, host_params, nnx_params: dict, other_params: dict) -> None:
    import jax
    import numpy as np

    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(host_params)}
    flat.update({f"nnx{k}": v for k, v in nnx_params.items()})
    flat.update(other_params)
    np.savez(os.path.join(out, "params.npz"), **flat)


def _mlp_ensemble():
    """The 4-member MLP ensemble over all processes' devices, its train step and Adam state."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import ensemble

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.tanh(nn.Dense(32)(x))
            return nn.Dense(1)(x)

    model = MLP()
    ens = ensemble.build(model, N_MEMBERS)
    params = ens.init(jax.random.key(0), jnp.zeros((BATCH, FEATURES)))["params"]
    # The library's own placement checks read this process's shards only.
    ensemble.assert_member_placement(params, ens.mesh)
    ensemble.assert_no_replicated_members(params, N_MEMBERS, ens.mesh)

    def loss_fn(p, x, y):
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    step = ensemble.train_step(
        loss_fn, optax.adam(1e-2), n=N_MEMBERS, mesh=ens.mesh, per_member_batch=True
    )
    return ens.mesh, params, step, step.init(params)


def _memory_report(step, params, opt_state, batch, rank: int) -> dict:
    import ensemble

    return {
        "live": {str(d): b for d, b in ensemble.live_memory((params, opt_state)).items()},
        "compiled_peak": ensemble.compiled_memory(step, params, opt_state, *batch).peak,
        "table": ensemble.print_memory(
            (params, opt_state), title=f"process {rank}", file=sys.stderr
        ),
    }


def main() -> int:
    args = _parse()
    info = distributed.initialize(
        heartbeat_timeout_seconds=args.heartbeat, shutdown_timeout_seconds=30
    )

    import jax
    import numpy as np

    import ensemble

    rank = info.process_id
    os.makedirs(args.out, exist_ok=True)
    mesh, params, step, opt_state = _mlp_ensemble()
    local = distributed.process_local_members(mesh, N_MEMBERS)

    def batch_at(t):
        xs, ys = zip(*(member_data(i, t) for i in local))
        return distributed.member_batch_from_local((np.stack(xs), np.stack(ys)), mesh, N_MEMBERS)

    memory = _memory_report(step, params, opt_state, batch_at(0), rank)
    t = 0
    losses = None
    idle_flag = os.path.join(args.out, "idle-rank-is-idle")  # the idle rank left collectives
    while args.forever or t < args.steps:
        x, y = batch_at(t % 8)
        old = params
        params, opt_state, losses = step(params, opt_state, x, y)
        donated = all(a.is_deleted() for a in jax.tree_util.tree_leaves(old))
        host_losses = distributed.gather_metrics_to_host(losses)
        if info.is_main:
            print(f"step {t} losses {np.round(host_losses, 4).tolist()}", flush=True)
        t += 1
        _fail_on_purpose(args, rank, t, idle_flag)
        if args.forever:
            time.sleep(0.2)

    same, other = _checkpoint_checks(args, params)
    ensemble.assert_member_placement((params, opt_state), mesh, N_MEMBERS)
    nnx_params, nnx_shards = train_nnx(args.steps, local)
    other_params, other_members = train_other_layouts(args.steps)
    host_params = distributed.gather_metrics_to_host(params)
    report = {
        **_placement_report(info, local, params),
        "nnx_shards": nnx_shards,
        "other_layout_members": {str(k): v for k, v in other_members.items()},
        "donated": donated,
        "losses": np.asarray(distributed.gather_metrics_to_host(losses)).tolist(),
        "checkpoint_roundtrip": same,
        "restored_other_max_diff": other,
        "memory": memory,
        "listening": listening_addresses(),
    }
    with open(os.path.join(args.out, f"report_{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    if info.is_main:
        _save_params(args.out, host_params, nnx_params, other_params)
        print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
