"""Population-based training (Jaderberg et al. 2017) across the ensemble's devices.

Every ``pbt_interval`` PPO updates the members are ranked by their recent return. Each member of
the bottom ``pbt_fraction`` copies a random member of the top ``pbt_fraction`` (exploit): its
parameters, optimizer state and observation / return normalisation statistics. It then
multiplies each of its per-member hyperparameters by one of ``pbt_factors`` at random and clips
the result to :data:`BOUNDS` (explore). A member keeps its own envs, episode bookkeeping and
random key, so parent and child go on to collect different experience.

The copy is a gather along the member axis of the sharded train state inside one jitted,
donated program whose output shardings equal its input shardings (:func:`gather_members`): the
members move between devices by collective permutes around a ring of the devices, one device's
block of members at a time, never through one host and never the whole population on one
device; it works unchanged when the members live on several processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ensemble import MEMBER_AXIS
from rollout.ppo._plots import member_colors, member_key

#: Clip ranges of the perturbed hyperparameters (keep a perturbed member trainable).
BOUNDS = {
    "learning_rate": (1e-6, 1e-1),
    "ent_coef": (0.0, 0.5),
    "clip_coef": (0.02, 0.5),
}

HPARAMS = tuple(BOUNDS)

#: The member-state fields a bottom member takes from its parent (everything learnt); the rest
#: (envs, running episodes, last returns, random key) stay the member's own.
COPIED = ("params", "opt_state", "obs_stats", "ret_stats", "hparams")


def plan(
    recent_returns: jax.Array, key: jax.Array, fraction: float, factors: Sequence[float]
) -> tuple[jax.Array, jax.Array]:
    """Who copies whom, and the perturbation factors; traceable, same result on every process.

    Members without a finite recent return (no finished episode yet) are left out of the
    ranking: they neither donate nor get replaced. Among the ``m`` ranked members the best
    ``c = floor(fraction * m)`` donate and the worst ``c`` are replaced (ties keep member order).

    Returns:
      ``parent`` ``[n]`` int32: the member whose learnt state each member takes (itself when it
      is not replaced), and ``factor`` ``[n, len(HPARAMS)]``: the multipliers (1 where not
      replaced).
    """
    n = recent_returns.shape[0]
    valid = jnp.isfinite(recent_returns)
    score = jnp.where(valid, recent_returns, -jnp.inf)
    order = jnp.argsort(-score, stable=True)  # best first; invalid members last
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    m = jnp.sum(valid.astype(jnp.int32))
    # floor(fraction * m) in Python's float64, as the config's check computes it (float32 on
    # the device gave floor(41 * (1/41)) = 0: no member replaced, where the check saw one).
    c = jnp.asarray([math.floor(fraction * k) for k in range(n + 1)], jnp.int32)[m]
    replaced = valid & (rank >= m - c) & (c > 0)
    k_parent, k_factor = jax.random.split(key)
    pick = jax.random.randint(k_parent, (n,), 0, jnp.maximum(c, 1))
    parent = jnp.where(replaced, order[pick], jnp.arange(n, dtype=jnp.int32))
    choice = jax.random.randint(k_factor, (n, len(HPARAMS)), 0, len(factors))
    factor = jnp.asarray(factors, jnp.float32)[choice]
    factor = jnp.where(replaced[:, None], factor, 1.0)
    return parent.astype(jnp.int32), factor


def gather_members(tree: Any, parent: jax.Array, mesh: Mesh) -> Any:
    """Every leaf's row ``i`` (member axis first) replaced by its row ``parent[i]``.

    ``jnp.take`` along a sharded member axis with indices known only at run time makes XLA
    all-gather every leaf: each device would hold the whole population for the step. Here the
    devices pass their blocks of members around a ring instead (a collective permute per hop,
    each hop's block the previous one's, so they run one after another), and each keeps the
    rows its own members want from each block as it goes by. Every block still reaches every
    device, but a device holds its own block, the one passing by and the result: about three
    blocks, whatever the number of devices.
    """
    blocks = mesh.shape[MEMBER_AXIS]
    ring = [(b, (b + 1) % blocks) for b in range(blocks)]

    def local(tree: Any, parent: jax.Array) -> Any:
        per = jax.tree_util.tree_leaves(tree)[0].shape[0]
        me = jax.lax.axis_index(MEMBER_AXIS)
        want = jax.lax.dynamic_slice_in_dim(parent, me * per, per)
        src_block, src_row = want // per, want % per

        def keep(held: Any, out: Any, block: jax.Array) -> Any:
            def one(h: jax.Array, o: jax.Array) -> jax.Array:
                here = (src_block == block).reshape((per,) + (1,) * (h.ndim - 1))
                return jnp.where(here, jnp.take(h, src_row, axis=0), o)

            return jax.tree_util.tree_map(one, held, out)

        def hop(k: jax.Array, carry: tuple) -> tuple:
            held, out = carry
            held = jax.lax.ppermute(held, MEMBER_AXIS, ring)
            return held, keep(held, out, (me - k) % blocks)

        # A loop, not unrolled hops: unrolled, XLA fuses every hop's selection into one at
        # the end, and every block that passed by is live at once.
        return jax.lax.fori_loop(1, blocks, hop, (tree, keep(tree, tree, me)))[1]

    spec = PartitionSpec(MEMBER_AXIS)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=spec)(
        tree, parent
    )


def exploit_explore(members: Any, parent: jax.Array, factor: jax.Array, mesh: Mesh) -> Any:
    """The new member state: learnt fields gathered from ``parent``, hyperparameters perturbed.

    ``members`` is a ``MemberState`` (member axis first on every leaf). The optimizer's
    injected ``learning_rate`` keeps its ratio to ``hparams['learning_rate']`` (the annealing
    fraction of the last update), so the optimizer and the hyperparameters agree afterwards.
    """
    new = gather_members({f: getattr(members, f) for f in COPIED}, parent, mesh)
    old_lr = new["hparams"]["learning_rate"]
    hparams = {}
    # A copy is clipped to the bounds whatever factor it drew (1.0 too); a kept member keeps
    # its values, even where it started outside them.
    copied = parent != jnp.arange(parent.shape[0])
    for j, name in enumerate(HPARAMS):
        lo, hi = BOUNDS[name]
        value = new["hparams"][name]
        changed = copied | (factor[:, j] != 1.0)
        hparams[name] = jnp.where(changed, jnp.clip(value * factor[:, j], lo, hi), value)
    injected = optax.tree_utils.tree_get(new["opt_state"], "learning_rate")
    ratio = injected / jnp.where(old_lr > 0, old_lr, 1.0)
    new["opt_state"] = optax.tree_utils.tree_set(
        new["opt_state"], learning_rate=(ratio * hparams["learning_rate"]).astype(injected.dtype)
    )
    new["hparams"] = hparams
    return members.replace(**new)


def make_step(learner: Any):
    """A ``(state, recent_returns, key) -> (state, (parent, hparams))`` step for ``learner``.

    One jitted program: the state is donated and keeps its shardings; ``parent`` and the new
    ``hparams`` come out replicated so every process can read them for the lineage. The small
    host inputs (returns, key) become replicated global arrays first, the form a jitted program
    over several processes' devices takes.
    """
    cfg = learner.config
    shardings = learner.state_shardings()
    replicated = NamedSharding(learner.mesh, PartitionSpec())
    factors = tuple(float(f) for f in cfg.pbt_factors)

    def step(state, recent_returns, key_data):
        key = jax.random.wrap_key_data(key_data)
        parent, factor = plan(recent_returns, key, cfg.pbt_fraction, factors)
        members = exploit_explore(state.members, parent, factor, learner.mesh)
        return state.replace(members=members), (parent, members.hparams)

    program = jax.jit(
        step,
        in_shardings=(shardings, replicated, replicated),
        out_shardings=(shardings, (replicated, replicated)),
        donate_argnums=0,
    )

    def global_array(x: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(x.shape, replicated, lambda index: x[index])

    def inputs(recent_returns, key) -> tuple[jax.Array, jax.Array]:
        returns = global_array(np.asarray(recent_returns, np.float32))
        return returns, global_array(np.asarray(jax.random.key_data(key)))

    def run(state, recent_returns, key):
        return program(state, *inputs(recent_returns, key))

    # The compiled program, for its memory and collectives (state: arrays or shapes).
    run.lower = lambda state: program.lower(
        state, *inputs(np.zeros(cfg.members), jax.random.key(0))
    )
    return run


def recent_returns(rows: Sequence[dict[str, Any]], window: int, n: int) -> np.ndarray:
    """Per member: mean return over the last ``window`` metric rows, ignoring missing (NaN)
    and the rows up to the member's last copy of another member (with a window longer than
    the interval, those are returns of weights it no longer has: a copy of the best member,
    scored on its own old returns, was replaced again at once)."""
    out = np.full((n,), np.nan, np.float32)
    recent = rows[-window:]
    if not recent:
        return out
    values = np.array(
        [[math.nan if v is None else v for v in r["returns"]] for r in recent], np.float64
    )
    for j, row in enumerate(recent):  # rows up to (and with) a copy are the parent's weights'
        parent = row.get("pbt_parent")
        if parent is not None:
            copied = np.asarray(parent) != np.arange(n)
            values[: j + 1, copied] = np.nan
    finite = np.isfinite(values)
    counts = finite.sum(axis=0)
    sums = np.where(finite, values, 0.0).sum(axis=0)
    has = counts > 0
    out[has] = (sums[has] / counts[has]).astype(np.float32)
    return out


def pbt_key(seed: int, update: int) -> jax.Array:
    """The PBT step's key: from the run's seed and the update count (same after a resume)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0x9B7), update)


def after_updates(
    learner: Any, state: Any, rows: list[dict[str, Any]], new_rows: list[dict[str, Any]], done: int
) -> Any:
    """The training loop's hook: lineage into the new rows, and a PBT step when one is due.

    ``rows``: the metric rows before this jitted call; ``new_rows``: its rows (the newest is
    update ``done``). Adds ``hparams`` (the per-member values in effect during the update) to
    each new row, and at a PBT step ``pbt_parent`` (the member each member copied; itself when
    kept) and ``pbt_hparams`` (the values the step set) to the newest. Returns the (donated
    and replaced, at a PBT step) state.
    """
    from rollout.ppo._learner import to_host

    cfg = learner.config
    record_hparams(state, new_rows)
    # The run's last update too, when it falls on the interval: a run extended later (a larger
    # --total-steps) then goes on from the state a longer run would have had at that update.
    if done % cfg.pbt_interval:
        return state
    returns = recent_returns([*rows, *new_rows], cfg.pbt_window, cfg.members)
    state, (parent, _) = learner.exploit_explore(state, returns, pbt_key(cfg.seed, done))
    new_rows[-1]["pbt_parent"] = [int(p) for p in to_host({"p": parent})["p"]]
    # The values the step set (in effect from the next update): a run's last PBT step has no
    # next row, and its checkpoint and exports hold these.
    new_rows[-1]["pbt_hparams"] = _hparams(state)
    return state


def record_hparams(state: Any, rows: list[dict[str, Any]]) -> None:
    """Adds ``hparams``, the per-member values ``state``'s updates ran with, to each row."""
    hp = _hparams(state)
    for row in rows:
        row["hparams"] = {k: list(v) for k, v in hp.items()}


def _hparams(state: Any) -> dict[str, list[float]]:
    from rollout.ppo._learner import to_host

    hp = to_host(dict(state.members.hparams))
    return {k: [float(f"{v:.7g}") for v in hp[k]] for k in HPARAMS}


def chunk(cfg: Any, done: int, k: int) -> int:
    """``k`` updates, cut short so that a jitted call ends on the next PBT step, in calls of
    one size where that costs little (see :func:`call_size`)."""
    if not cfg.pbt:
        return k
    size = call_size(cfg.pbt_interval, cfg.updates_per_call)
    return min(k, size, cfg.pbt_interval - done % cfg.pbt_interval)


def call_size(interval: int, most: int) -> int:
    """Updates per jitted call under PBT: each size compiles its own update program, so an
    interval of 10 in calls of at most 8 runs as 5 + 5 (one program), not 8 + 2 (two). The
    largest divisor of ``interval`` up to ``most``, unless it is below half of ``most`` (13:
    8 + 5 then, not 13 calls of 1).

    Example:
      >>> [call_size(i, 8) for i in (4, 10, 12, 13, 20)]
      [4, 5, 6, 8, 5]
    """
    if interval <= most:
        return interval
    divisor = max(d for d in range(1, most + 1) if interval % d == 0)
    return divisor if 2 * divisor >= most else most


def plot_lineage(rows: Sequence[dict[str, Any]], path: Any, title: str = "") -> None:
    """Each member's hyperparameters over time, and who copied whom at every PBT step."""
    from matplotlib.figure import Figure  # not pyplot: see plot_curves

    rows = [r for r in rows if "hparams" in r]
    if not rows:
        return
    n = len(rows[0]["hparams"]["learning_rate"])
    steps = np.array([r["env_steps"] for r in rows])
    fig = Figure(figsize=(9, 9), layout="constrained")
    axes = fig.subplots(len(HPARAMS) + 1, 1, sharex=True)
    colors = member_colors(n)  # as learning_curve.png colours its members
    # Each row's values, then at a PBT step the values it set: a step, at that update.
    xs = [x for r, x in zip(rows, steps) for _ in range(1 + ("pbt_hparams" in r))]
    for ax, name in zip(axes, HPARAMS, strict=False):
        for i in range(n):
            ys = [h[name][i] for r in rows for h in (r["hparams"], r.get("pbt_hparams")) if h]
            ax.plot(xs, ys, color=colors[i], lw=1.1, label=f"member {i}")
        ax.set_ylabel(name)
        if name == "learning_rate":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for i in range(n):
        ax.axhline(i, color=colors[i], lw=0.6, alpha=0.5)
    for r in rows:
        for child, par in enumerate(r.get("pbt_parent") or []):
            if par != child:
                ax.annotate(
                    "",
                    xy=(r["env_steps"], child),
                    xytext=(r["env_steps"], par),
                    arrowprops=dict(arrowstyle="->", color=colors[par], lw=1.0),
                )
    ax.set_ylabel("member (arrow: parent -> child)")
    ax.set_xlabel("env steps per member")
    ax.set_ylim(-0.5, n - 0.5)
    axes[0].set_title(f"PBT lineage {title} (n={n})")
    member_key(fig, axes, n)
    fig.savefig(path, dpi=110)
