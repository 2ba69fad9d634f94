"""The ensemble PPO learner: n actor-critics, one jitted and donated update for all of them.

Read :meth:`Learner._update` top to bottom: one PPO update of the whole ensemble (rollout, GAE,
epochs of shuffled minibatches). The per-member pieces (:meth:`Learner._act`,
:meth:`Learner._observe`, :meth:`Learner._learn`) are written for a single agent; the ensemble's
member runner (``ens.members.map``, a manual member axis) runs them for every member. With a
functional env on device, one member's whole update is one plain program next to its envs;
host envs (CPU workers, gymnasium, EnvPool) step between the per-member pieces at ensemble
level. The member-major train state, sharded on the mesh's ``'ensemble'`` axis, keeps each
member on its own device(s): nothing member-shaped is ever gathered, and ``out_shardings`` equal
the input shardings so the donated buffers are reused in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.struct as struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import ensemble
from ensemble._core import explained_errors
from rollout._devices import memory_of
from rollout._relay import wait_for_outputs
from rollout.ppo import _env as envlib
from rollout.ppo import _networks as nets
from rollout.ppo._config import PPOConfig
from rollout.ppo._gae import gae


class RunningStats(NamedTuple):
    """Running mean / variance (Welford, batched merge) as in gymnasium's normalisation wrappers.

    Example:
      >>> import jax.numpy as jnp
      >>> stats = RunningStats.zeros((2,)).update(jnp.array([[0.0, 1.0], [2.0, 3.0]]))
      >>> stats.mean.round(3).tolist(), stats.var.round(3).tolist()
      ([1.0, 2.0], [1.0, 1.0])
    """

    mean: jax.Array
    var: jax.Array
    count: jax.Array

    @classmethod
    def zeros(cls, shape: tuple[int, ...]) -> RunningStats:
        """Empty statistics of values of ``shape``: mean 0, variance 1, a count of 1e-4."""
        # count starts at a tiny epsilon like gymnasium's RunningMeanStd (avoids 0/0).
        f32 = jnp.float32  # also under jax_enable_x64, as every other leaf of the state
        return cls(jnp.zeros(shape, f32), jnp.ones(shape, f32), jnp.asarray(1e-4, f32))

    def update(self, batch: jax.Array) -> RunningStats:
        """These statistics merged with those of ``batch`` (its axis 0 is the sample axis)."""
        b_mean = jnp.mean(batch, axis=0)
        b_var = jnp.var(batch, axis=0)
        b_count = jnp.asarray(batch.shape[0], jnp.float32)
        delta = b_mean - self.mean
        total = self.count + b_count
        mean = self.mean + delta * b_count / total
        m2 = self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / total
        return RunningStats(mean, m2 / total, total)


@struct.dataclass
class MemberState:
    """Everything that belongs to the members; every leaf has the member axis first.

    Example:
      >>> from rollout.ppo import Learner, PPOConfig
      >>> learner = Learner(PPOConfig.for_env("cartpole", members=8, num_envs=2))
      >>> members = learner.state_shapes().members  # shapes only: nothing runs
      >>> members.obs.shape, members.last_return.shape, sorted(members.hparams)
      ((8, 2, 4), (8,), ['clip_coef', 'ent_coef', 'learning_rate'])
    """

    params: Any
    opt_state: Any
    env_state: Any  # [n, num_envs, ...]
    obs: jax.Array  # [n, num_envs, *obs_shape], raw (unnormalised) current observations
    obs_stats: RunningStats  # [n, *obs_shape] (count [n])
    ret_stats: RunningStats  # [n] reward-scaling statistics of the discounted return
    disc_return: jax.Array  # [n, num_envs] discounted return used for reward scaling
    ep_return: jax.Array  # [n, num_envs] undiscounted return of the running episodes
    ep_length: jax.Array  # [n, num_envs]
    last_return: jax.Array  # [n] mean return of episodes finished last update (NaN: none)
    last_length: jax.Array  # [n]
    hparams: dict[str, jax.Array]  # per-member learning_rate, ent_coef, clip_coef: [n]
    rng: jax.Array  # [n, 2] uint32 raw keys ([n, 4] for rbg; plain arrays: easy to checkpoint)


@struct.dataclass
class TrainState:
    """The whole learner state: ``members`` (sharded on the member axis) and the update counter.

    Example:
      >>> from rollout.ppo import Learner, PPOConfig
      >>> learner = Learner(PPOConfig.for_env("cartpole", members=8))
      >>> shardings = learner.state_shardings()  # a TrainState of shardings
      >>> shardings.update.spec, shardings.members.rng.spec  # replicated / one member a device
      (P(), P('ensemble', None))
    """

    members: MemberState
    update: jax.Array  # () int32, replicated: PPO updates done so far


class Rollout(NamedTuple):
    """What one member carries from env step to env step during the rollout."""

    env_state: Any
    obs: jax.Array
    obs_stats: RunningStats
    ret_stats: RunningStats
    disc_return: jax.Array
    ep_return: jax.Array
    ep_length: jax.Array
    finished: jax.Array  # [3]: sum of returns, sum of lengths, count of episodes finished
    rng: jax.Array


# What a rollout takes from the member state and hands back (all but its own episode tally).
_CARRIED = tuple(name for name in Rollout._fields if name != "finished")
_POOL_SEEDS = 0x9E3779B9  # EnvPool's pool seeds: a stream of the run's seed apart from others'


class Act(NamedTuple):
    """One member's decision for its envs at one step."""

    obs: jax.Array  # normalised observation the policy saw
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array | None  # None: computed after the rollout (``critic_apart`` networks)
    env_action: jax.Array  # the action as the env takes it (clipped into the box)
    env_keys: jax.Array  # one key per env


class Draws(NamedTuple):
    """One member's randomness for a whole rollout, drawn before it, ``[num_steps, num_envs, ...]``.

    Drawn at once rather than step by step: on CPU each ``jax.random`` call inside the rollout
    loop is a small loop of its own, which cost as much per step as the policy itself.
    """

    noise: jax.Array  # the action draws (see nets.noise)
    env_keys: jax.Array  # one key per env and step


class Cut(NamedTuple):
    """Per step: the true final observation (normalised) and whether time ran out there."""

    final_obs: jax.Array
    cut: jax.Array  # 1.0 where the episode was truncated (not terminated) at this step


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array | None  # None until _advantages for ``critic_apart`` networks
    reward: jax.Array  # the (scaled, truncation-bootstrapped) reward the learner trains on
    done: jax.Array


METRIC_NAMES = (
    "returns",
    "episode_length",
    "episodes",
    "policy_loss",
    "value_loss",
    "entropy",
    "approx_kl",
    "clipfrac",
    "learning_rate",
)


class Learner:
    """n PPO agents trained together; each member on its own device(s) of ``mesh``.

    Args:
      config: a :class:`PPOConfig` (validated here, before anything is compiled).
      mesh: an ensemble mesh (default ``ensemble.make_mesh(config.members, devices=devices)``).
      devices: devices for the default mesh (default: all).
      env: an environment object instead of ``config.env``'s name: a functional env following
        ``rollout.envs.Env`` (yours, or ``rollout.envs.make('gymnax:...')``), or a host env
        (``rollout.envs.make('gymnasium:HalfCheetah-v5', **make_kwargs)``). ``config.env`` is
        then only its label. A functional env must restart its episodes (``AutoReset``, which
        puts ``final_obs`` in ``info``), match its spaces and return what the API says, with
        no Python state kept on the object: checked here, by tracing one step abstractly
        (``ValueError`` otherwise).

    Example:
      >>> import jax
      >>> from rollout.ppo import Learner, PPOConfig
      >>> cfg = PPOConfig.for_env("cartpole", members=jax.device_count(), total_steps=1024)
      >>> learner = Learner(cfg)
      >>> state = learner.init()
      >>> state, metrics = learner.update(state, 2)
      >>> metrics["returns"].shape == (cfg.members, 2)
      True
      >>> leaf = jax.tree.leaves(state.members.params)[0]  # one member's rows per device
      >>> [s.data.shape[0] for s in leaf.addressable_shards] == [1] * jax.device_count()
      True
    """

    def __init__(
        self,
        config: PPOConfig,
        *,
        mesh: Mesh | None = None,
        devices: Sequence[jax.Device] | None = None,
        env: Any = None,
    ) -> None:
        devices = list(mesh.devices.flat) if mesh is not None else devices
        num_devices = len(devices) if devices is not None else jax.device_count()
        known = envlib.known_envs() if env is None else ()
        config.validate(num_devices=num_devices, known_envs=known)
        self.config = config
        self.env = envlib.make_env(config.env, config.make_kwargs()) if env is None else env
        # Whether the run's config makes this env again (the CLI's --resume, evaluate).
        self.env_from_config = env is None or envlib.made_by_config(config, env)
        self.spec = envlib.spec_of(self.env)
        n = config.members
        self.mesh = mesh if mesh is not None else ensemble.make_mesh(n, devices=devices)
        self.network = nets.make_network(self.spec, config.hidden)
        _refuse_a_state_too_big(self.network, self.spec, self.mesh, config)
        self.ensemble = ensemble.build(self.network, n, mesh=self.mesh)
        self.normalize_obs = envlib.normalize_obs(config, self.spec)
        self.obs_dtype = envlib.obs_dtype(config, self.spec)
        self.normalize_reward = (
            (not self.spec.discrete) if config.normalize_reward is None else config.normalize_reward
        )
        # One member's optimizer; per_member vmaps it (one Adam state per member) for init, and
        # the member update below runs it inside the member vmap, so clip_by_global_norm sees one
        # member's gradients only.
        self.tx = optax.inject_hyperparams(_adam_with_clip)(
            learning_rate=config.per_member("learning_rate")[0],
            max_grad_norm=config.max_grad_norm,
        )
        if not hasattr(self.env, "bind"):
            envlib.check_functional_env(self.env, self.spec)
        # Every member's envs behind one interface (reset / step on [n, num_envs, ...]).
        self.envs = envlib.member_envs(self.env, config, self.mesh)
        # A functional env on device steps inside each member's own program (no host trip).
        self._host_envs = hasattr(self.env, "bind")
        self._envs_beside_members = config.env_on == "device" and not self._host_envs
        self._programs: dict[int, Callable[..., Any]] = {}
        self._run_length_array: jax.Array | None = None  # see _run_length
        self._init_program: Any = None  # kept: train(..., learner=) reuses what it compiled
        self._state_shardings: Any = None
        self._pbt_step: Any = None
        self._dispatched: Any = None  # the latest update's metrics: close() waits for them

    # ------------------------------------------------------------------ state

    def init(self, seed: int | None = None) -> TrainState:
        """A fresh train state, every member-shaped leaf on the member axis from the start."""
        cfg, n = self.config, self.config.members
        _refuse_debug_nans()
        seed = cfg.seed if seed is None else seed
        k_params, k_members = jax.random.split(jax.random.key(seed))
        # One row per 'data' device of a member: a batch that splits evenly (no warning).
        sample_obs = jnp.zeros((self.mesh.shape["data"], *self.spec.obs_shape), jnp.float32)
        params = self.ensemble.init(k_params, sample_obs)["params"]
        member_keys = jax.random.key_data(jax.random.split(k_members, n))
        hparams = {k: jnp.asarray(cfg.per_member(k), jnp.float32) for k in _HPARAMS}
        if self._init_program is None:
            shardings = self.state_shardings()
            self._init_program = jax.jit(self._init_state, out_shardings=shardings)
        with jax.set_mesh(self.mesh), _explained():
            return self._init_program(params, member_keys, hparams)

    def _init_state(self, params, member_keys, hparams) -> TrainState:
        cfg, n = self.config, self.config.members
        opt_state = ensemble.per_member(self.tx, n, learning_rate=hparams["learning_rate"]).init(
            params
        )

        def keys(key):
            key, k_env = jax.random.split(jax.random.wrap_key_data(key))
            return jax.random.key_data(key), jax.random.split(k_env, cfg.num_envs)

        rngs, env_keys = self.ensemble.members.map(keys, (member_keys,), (0,))
        env_state, obs = self.envs.reset(env_keys)  # all members' envs, [n, num_envs, ...]

        def one(key, obs):
            obs = obs.astype(self.obs_dtype)
            obs_stats = RunningStats.zeros(self.spec.obs_shape)
            if self.normalize_obs:
                obs_stats = obs_stats.update(obs)
            zeros = jnp.zeros((cfg.num_envs,), jnp.float32)
            return dict(
                obs=obs,
                obs_stats=obs_stats,
                ret_stats=RunningStats.zeros(()),
                disc_return=zeros,
                ep_return=zeros,
                ep_length=zeros,
                last_return=jnp.asarray(jnp.nan, jnp.float32),
                last_length=jnp.asarray(jnp.nan, jnp.float32),
                rng=key,
            )

        parts = self.ensemble.members.map(one, (rngs, obs), (0, 0))
        members = MemberState(
            params=params, opt_state=opt_state, hparams=hparams, env_state=env_state, **parts
        )
        return TrainState(members=members, update=jnp.zeros((), jnp.int32))

    def state_shardings(self) -> TrainState:
        """``NamedSharding`` of every leaf of the train state (member axis on ``'ensemble'``).

        When a member spans several devices (fewer members than devices), its state is
        replicated over the ``'data'`` devices of its group: splitting its few envs over them
        was measured 6x slower on CPU devices (a collective every env step), so each device of
        the group runs the member whole.
        """
        if self._state_shardings is None:
            shapes = self.state_shapes()
            member = jax.tree_util.tree_map(
                lambda x: ensemble.member_sharding(self.mesh, x.ndim), shapes.members
            )
            replicated = NamedSharding(self.mesh, PartitionSpec())
            self._state_shardings = TrainState(members=member, update=replicated)
        return self._state_shardings

    def state_shapes(self) -> TrainState:
        """Shapes and dtypes of the train state (nothing is computed)."""
        n = self.config.members
        params = jax.eval_shape(
            lambda k: jax.vmap(self.network.init, in_axes=(0, None))(
                jax.random.split(k, n), jnp.zeros((1, *self.spec.obs_shape), jnp.float32)
            )["params"],
            jax.random.key(0),
        )
        # raw key data: (n, 2) for threefry, (n, 4) for the rbg generators (jax_default_prng_impl)
        keys = jax.eval_shape(lambda: jax.random.key_data(jax.random.split(jax.random.key(0), n)))
        hparams = {k: jax.ShapeDtypeStruct((n,), jnp.float32) for k in _HPARAMS}
        return jax.eval_shape(self._init_state, params, keys, hparams)

    # ------------------------------------------------------------------ update

    def update(self, state: TrainState, num_updates: int | None = None) -> tuple[TrainState, dict]:
        """Runs ``num_updates`` PPO updates (default ``config.updates_per_call``) in one jit call.

        ``state`` is donated (do not use it afterwards). Returns the new state and metrics, a dict
        of ``[n, num_updates]`` arrays sharded on the member axis (see ``METRIC_NAMES``). With
        ``anneal_lr``, updates past ``config.num_updates`` run at learning rate 0 (the schedule
        has ended; set ``anneal_lr=False`` to train open-ended).
        """
        k = self.config.updates_per_call if num_updates is None else int(num_updates)
        _refuse_debug_nans()
        if k <= 0:
            raise ValueError(f"num_updates must be positive, got {k}.")
        _refuse_donated(state)
        program = self._program(k, state, live=True)
        with jax.set_mesh(self.mesh), _explained():
            state, self._dispatched = program(state, self._run_length())
        return state, self._dispatched

    def _program(self, k: int, state: Any, live: bool) -> Callable[..., Any]:
        """The jitted program of ``k`` updates, compiled for ``state`` (arrays, or shapes) and
        refused where it cannot fit in memory (:class:`StateTooLarge`); the call reuses it.
        ``live``: the state's arrays already hold their memory."""
        program = self._programs.get(k)
        if program is None:
            program = self._compile_updates(k)
            with jax.set_mesh(self.mesh), _explained():  # its errors as the call's would be
                compiled = program.lower(state, self._run_length()).compile()
            try:
                need = ensemble.compiled_memory(compiled)
            except RuntimeError:  # a backend without a memory analysis: nothing to check
                need = None
            if need is not None:
                _refuse_an_update_too_big(need, self.mesh, self.config, k, live)
            self._programs[k] = program
        return program

    def lower(self, state: TrainState, num_updates: int = 1) -> jax.stages.Lowered:
        """The lowered update program (``.compile().memory_analysis()``, ``.as_text()``)."""
        with jax.set_mesh(self.mesh), _explained():
            return self._compile_updates(num_updates).lower(state, self._run_length())

    def _run_length(self) -> jax.Array:
        """``config.num_updates`` as a replicated input of the update program, where the
        learning-rate schedule ends. An input, not a constant: runs that differ only in
        ``total_steps`` (a resume that extends a run) compile the same program, so a later one
        takes it from JAX's persistent compilation cache. Made by a program of its own (a
        constant, not a host transfer, which ``jax_transfer_guard`` may forbid), once."""
        if self._run_length_array is None:
            replicated = NamedSharding(self.mesh, PartitionSpec())
            value = float(self.config.num_updates)
            make = jax.jit(lambda: jnp.asarray(value, jnp.float32), out_shardings=replicated)
            self._run_length_array = make()
        return self._run_length_array

    def _compile_updates(self, k: int) -> Callable[..., Any]:
        shardings = self.state_shardings()
        metric_sharding = ensemble.member_sharding(self.mesh, 2)
        metrics_out = dict.fromkeys(METRIC_NAMES, metric_sharding)

        def updates(state: TrainState, run_length: jax.Array) -> tuple[TrainState, dict]:
            def one(state: TrainState, _):
                members, metrics = self._update(state.members, state.update, run_length)
                return TrainState(members=members, update=state.update + 1), metrics

            state, metrics = jax.lax.scan(one, state, None, length=k)
            # scan stacks updates first: [k, n] -> [n, k], member axis first like everything else.
            return state, {name: m.T for name, m in metrics.items()}

        return jax.jit(
            updates,
            in_shardings=(shardings, NamedSharding(self.mesh, PartitionSpec())),
            out_shardings=(shardings, metrics_out),
            donate_argnums=0,
        )

    def _update(
        self, ms: MemberState, update: jax.Array, run_length: jax.Array
    ) -> tuple[MemberState, dict]:
        """One PPO update of the whole ensemble, every array member-major.

        1. Rollout: ``num_steps`` steps. Each step every member picks actions for its envs
           (:meth:`_act`), all members' envs step together (:meth:`_step_envs`: vmapped next to
           the members, or on host CPU cores), and each member books the outcome
           (:meth:`_observe`).
        2. Learning: each member runs GAE and its epochs of minibatches on its own trajectory
           (:meth:`_learn`).

        Per-member code runs through the ensemble's member runner (``ens.members.map``: a
        manual member axis, so nothing crosses members and no trajectory is ever gathered).
        With envs on device, the WHOLE update of one member (its rollout, then its learning) is
        one plain single-agent program, run once per member.
        """
        members = self.ensemble.members
        # Linear learning-rate annealing to 0 over the run (CleanRL), the same for every
        # member; 0 after its end (updates past num_updates, called directly), never negative.
        frac = jnp.float32(1.0)
        if self.config.anneal_lr:
            frac = jnp.maximum(1.0 - update.astype(jnp.float32) / run_length, 0.0)
        if self._envs_beside_members:
            return members.map(self._member_update, (ms, frac), (0, None))
        carry, traj = self._rollout(ms, update)
        return members.map(self._learn, (ms, carry, traj, frac), (0, 0, 0, None))

    def _rollout(self, ms: MemberState, update: jax.Array) -> tuple[Rollout, tuple]:
        """All members' rollouts, the envs stepped together at ensemble level (host envs):
        the final carry and the trajectory, ``[n, num_steps, num_envs, ...]``."""
        if self._envs_beside_members:
            return self.ensemble.members.map(self._member_rollout, (ms,), (0,))
        per_member = lambda fn, *args: self.ensemble.members.map(fn, args, (0,) * len(args))
        carry = self._rollout_carry(ms, (self.config.members,))
        carry, draws = per_member(self._draw, carry)
        draws = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), draws)  # [num_steps, n, ...]
        if self._host_envs:  # their restart seeds, derived once here rather than every step
            # EnvPool's pools start from a key of the run's and the update's, the same on every
            # device: from member 0's key, a device whose envs failed left the others waiting
            # for it in that collective until XLA aborted the process.
            start = jax.random.fold_in(jax.random.key(self.config.seed ^ _POOL_SEEDS), update)
            start = jax.random.split(start, self.config.num_steps)
            draws = draws._replace(env_keys=self.envs.seeds(draws.env_keys, start))

        def step(carry: Rollout, draw: Draws):
            act = per_member(self._act, ms.params, carry, draw)
            out = self._step_envs(carry.env_state, act.env_action, act.env_keys)
            return per_member(self._observe, carry, act, out)

        carry, traj = jax.lax.scan(step, carry, draws)
        # traj leaves are [num_steps, n, num_envs, ...]: the member axis goes first.
        return carry, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), traj)

    def _member_update(self, ms: MemberState, frac: jax.Array) -> tuple[MemberState, dict]:
        """One member's whole update with its envs stepped next to it (``env_on='device'``)."""
        carry, traj = self._member_rollout(ms)
        return self._learn(ms, carry, traj, frac)

    def _member_rollout(self, ms: MemberState) -> tuple[Rollout, tuple[Transition, Cut]]:
        """One member's rollout with its envs stepped next to it, in its own program."""
        env_step = jax.vmap(self.env.step)

        def step(carry: Rollout, draw: Draws):
            act = self._act(ms.params, carry, draw)
            return self._observe(
                carry, act, env_step(carry.env_state, act.env_action, act.env_keys)
            )

        carry, draws = self._draw(self._rollout_carry(ms, ()))
        return jax.lax.scan(step, carry, draws)

    @staticmethod
    def _after_rollout(ms: MemberState, carry: Rollout) -> MemberState:
        """``ms`` advanced by a rollout: its envs, observations, statistics, episode counters
        and key taken from the rollout's final ``carry`` (per member, or all members at once)."""
        return ms.replace(**{name: getattr(carry, name) for name in _CARRIED})

    def _rollout_carry(self, ms: MemberState, lead: tuple[int, ...]) -> Rollout:
        finished = jnp.zeros((*lead, 3), jnp.float32)
        return Rollout(finished=finished, **{name: getattr(ms, name) for name in _CARRIED})

    # ---- one member's pieces (written for a single agent; the ensemble vmaps them) ----------

    def _normalize(self, obs: jax.Array, stats: RunningStats) -> jax.Array:
        if not self.normalize_obs:
            return obs
        # Broadcast explicitly: also under jax_numpy_rank_promotion='raise'.
        mean, var = (jnp.broadcast_to(s, obs.shape) for s in (stats.mean, stats.var))
        return jnp.clip((obs - mean) / jnp.sqrt(var + 1e-8), -10.0, 10.0)

    def _draw(self, carry: Rollout) -> tuple[Rollout, Draws]:
        """This member's action noise and env keys for the whole rollout (see ``Draws``)."""
        cfg, spec = self.config, self.spec
        key, k_act, k_env = jax.random.split(jax.random.wrap_key_data(carry.rng), 3)
        shape = (cfg.num_steps, cfg.num_envs)
        draws = Draws(
            noise=nets.noise(k_act, shape, spec.discrete, spec.action_dim),
            env_keys=jax.random.split(k_env, shape),
        )
        return carry._replace(rng=jax.random.key_data(key)), draws

    def _act(self, params: Any, carry: Rollout, draw: Draws) -> Act:
        """Sample actions for this member's envs from the current policy."""
        obs = self._normalize(carry.obs, carry.obs_stats)
        if self.network.critic_apart:  # V comes after the rollout, batched (_advantages)
            pi, value = self.network.apply({"params": params}, obs, method="policy"), None
        else:
            pi, value = self.network.apply({"params": params}, obs)
        action = nets.sample(pi, draw.noise, self.spec.discrete, self.spec.action_groups)
        return Act(
            obs=obs,
            action=action,
            log_prob=nets.log_prob(pi, action, self.spec.discrete, self.spec.action_groups),
            value=value,
            env_action=envlib.to_env_action(action, self.spec),
            env_keys=draw.env_keys,
        )

    def _observe(
        self, carry: Rollout, act: Act, out: tuple
    ) -> tuple[Rollout, tuple[Transition, Cut]]:
        """Book one env step: episode stats, reward scaling, truncation bootstrap, obs stats."""
        cfg = self.config
        env_state, next_obs, reward, term, trunc, info = out
        next_obs = next_obs.astype(self.obs_dtype)
        reward = reward.astype(jnp.float32)
        term, trunc = term.astype(bool), trunc.astype(bool)
        done = term | trunc

        ep_return, ep_length, finished = _episode_stats(carry, reward, done, info)

        # Reward scaling (CleanRL's NormalizeReward, gym 0.23's): divide by the discounted
        # return's std. The ending step adds to the running return, which restarts after every
        # episode end, truncations too (gymnasium 1.x's wrapper restarts it at a terminating
        # step itself, and carries it across a truncation into the next episode).
        train_reward, disc_return, ret_stats = reward, carry.disc_return, carry.ret_stats
        if self.normalize_reward:
            disc_return = disc_return * cfg.gamma + reward
            ret_stats = ret_stats.update(disc_return)
            disc_return = jnp.where(done, 0.0, disc_return)
            train_reward = jnp.clip(reward / jnp.sqrt(ret_stats.var + 1e-8), -10.0, 10.0)
        # A time-limit cut is not a terminal state: it is bootstrapped with V(true final obs).
        # The values are computed after the rollout in one batched critic call (_learn), so
        # here only the (normalised) final observation is kept.
        obs_stats = carry.obs_stats
        final = self._normalize(envlib.final_obs(info).astype(self.obs_dtype), obs_stats)
        cut = (trunc & ~term).astype(jnp.float32)
        # Kept only where it is used: a terminated episode's last observation may be anything
        # (NaN where the env ended it for leaving its valid states), and 0 * NaN is NaN.
        final = jnp.where(jnp.expand_dims(cut, range(cut.ndim, final.ndim)) > 0, final, 0)
        if self.normalize_obs:
            obs_stats = obs_stats.update(next_obs)

        carry = Rollout(
            env_state=env_state,
            obs=next_obs,
            obs_stats=obs_stats,
            ret_stats=ret_stats,
            disc_return=disc_return,
            ep_return=ep_return,
            ep_length=ep_length,
            finished=finished,
            rng=carry.rng,
        )
        step = Transition(
            act.obs, act.action, act.log_prob, act.value, train_reward, done.astype(jnp.float32)
        )
        return carry, (step, Cut(final, cut))

    def _learn(
        self, ms: MemberState, carry: Rollout, steps: tuple[Transition, Cut], frac: jax.Array
    ) -> tuple[MemberState, dict]:
        """GAE, then ``update_epochs`` passes of shuffled minibatches; one member's update,
        at its learning rate times ``frac`` (the annealing schedule's, see :meth:`_update`)."""
        cfg = self.config
        batch = self._advantages(ms, carry, steps)
        batch = jax.tree_util.tree_map(lambda x: x.reshape(cfg.batch_size, *x.shape[2:]), batch)
        lr = ms.hparams["learning_rate"] * frac
        key = jax.random.wrap_key_data(carry.rng)
        params, opt_state, key, stats = self._epochs(ms, batch, lr, key)

        # Metrics: scalars per member (the ensemble vmap makes them [n]).
        fin_sum, fin_len, fin_count = carry.finished
        # NaN when no episode finished in this update (a long episode spanning updates): an
        # earlier update's return repeated here would pass for a fresh one (metrics, PBT).
        has = fin_count > 0
        last_return = jnp.where(has, fin_sum / jnp.maximum(fin_count, 1.0), jnp.nan)
        last_length = jnp.where(has, fin_len / jnp.maximum(fin_count, 1.0), jnp.nan)
        metrics = {name: jnp.mean(v) for name, v in stats.items()}
        metrics.update(
            returns=last_return, episode_length=last_length, episodes=fin_count, learning_rate=lr
        )
        new = self._after_rollout(ms, carry).replace(
            params=params,
            opt_state=opt_state,
            last_return=last_return,
            last_length=last_length,
            rng=jax.random.key_data(key),
        )
        return new, {name: jnp.asarray(metrics[name], jnp.float32) for name in METRIC_NAMES}

    def _advantages(
        self, ms: MemberState, carry: Rollout, steps: tuple[Transition, Cut]
    ) -> tuple[Transition, jax.Array, jax.Array]:
        """``(trajectory, advantages, value targets)``, ``[num_steps, num_envs, ...]`` each."""
        cfg, apply = self.config, self.network.apply
        traj, cuts = steps
        if traj.value is None:  # the rollout ran the actor alone (critic_apart)
            traj = traj._replace(value=apply({"params": ms.params}, traj.obs, method="value"))
        if cfg.bootstrap_truncation:  # reward += gamma * V(final obs) where time ran out
            final_value = apply({"params": ms.params}, cuts.final_obs, method="value")
            traj = traj._replace(reward=traj.reward + cuts.cut * cfg.gamma * final_value)
        # GAE over the trajectory, bootstrapped with V(obs after the last step).
        last_obs = self._normalize(carry.obs, carry.obs_stats)
        last_value = apply({"params": ms.params}, last_obs, method="value")
        advantages, targets = gae(
            traj.reward, traj.value, traj.done, last_value, cfg.gamma, cfg.gae_lambda
        )
        return traj, advantages, targets

    def _loss(self, params: Any, hp: dict, mb: tuple) -> tuple[jax.Array, dict]:
        """CleanRL's PPO loss on one minibatch ``(transitions, advantages, targets)``."""
        cfg, spec = self.config, self.spec
        t, adv, target = mb
        pi, value = self.network.apply({"params": params}, t.obs)
        logp = nets.log_prob(pi, t.action, spec.discrete, spec.action_groups)
        log_ratio = logp - t.log_prob
        ratio = jnp.exp(log_ratio)
        if cfg.norm_adv:  # per minibatch; population std (PureJaxRL's; CleanRL's torch: ddof=1)
            adv = _normalized(adv)
        clip = hp["clip_coef"]
        pg_loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - clip, 1 + clip)).mean()
        if cfg.clip_vloss:
            v_clipped = t.value + jnp.clip(value - t.value, -clip, clip)
            v_loss = 0.5 * jnp.maximum((value - target) ** 2, (v_clipped - target) ** 2).mean()
        else:
            v_loss = 0.5 * ((value - target) ** 2).mean()
        ent = nets.entropy(pi, spec.discrete, spec.action_groups).mean()
        loss = pg_loss - hp["ent_coef"] * ent + cfg.vf_coef * v_loss
        stats = dict(
            policy_loss=pg_loss,
            value_loss=v_loss,
            entropy=ent,
            approx_kl=((ratio - 1) - log_ratio).mean(),
            clipfrac=(jnp.abs(ratio - 1) > clip).astype(jnp.float32).mean(),
        )
        return loss, stats

    def _epochs(
        self, ms: MemberState, batch: tuple, lr: jax.Array, key: jax.Array
    ) -> tuple[Any, Any, jax.Array, dict]:
        """``update_epochs`` passes of shuffled minibatches over ``batch`` (``[batch_size, ...]``
        leaves): ``(params, opt_state, key, stats)``, stats ``[epochs, minibatches]``."""
        cfg = self.config

        def minibatch_step(carry, mb):
            params, opt_state = carry
            grads, stats = jax.grad(self._loss, has_aux=True)(params, ms.hparams, mb)
            # This member's optimizer: its global-norm clip sees only this member's gradients.
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), stats

        def epoch(carry, _):
            params, opt_state, key = carry
            key, k_perm = jax.random.split(key)
            perm = jax.random.permutation(k_perm, cfg.batch_size)
            mbs = jax.tree_util.tree_map(
                lambda x: x[perm].reshape(cfg.num_minibatches, cfg.minibatch_size, *x.shape[1:]),
                batch,
            )
            (params, opt_state), stats = jax.lax.scan(minibatch_step, (params, opt_state), mbs)
            return (params, opt_state, key), stats

        opt_state = optax.tree_utils.tree_set(ms.opt_state, learning_rate=lr)
        (params, opt_state, key), stats = jax.lax.scan(
            epoch, (ms.params, opt_state, key), None, length=cfg.update_epochs
        )
        return params, opt_state, key, stats

    def exploit_explore(
        self, state: TrainState, recent_returns: Any, key: jax.Array
    ) -> tuple[TrainState, tuple[jax.Array, dict[str, jax.Array]]]:
        """One population-based-training step on the devices (see ``rollout.ppo._pbt``).

        ``recent_returns``: ``[n]`` per-member scores (NaN: not ranked). ``state`` is donated.
        Returns the new state (same shardings) and ``(parent, hparams)``, replicated: the member
        each member copied (itself if kept) and the new per-member hyperparameters.
        """
        from rollout.ppo import _pbt

        n = self.config.members
        if np.shape(recent_returns) != (n,):
            raise ValueError(
                f"recent_returns must hold one score per member, shape ({n},); got shape "
                f"{np.shape(recent_returns)}."
            )
        if self._pbt_step is None:
            self._pbt_step = _pbt.make_step(self)
        _refuse_donated(state)
        with jax.set_mesh(self.mesh):
            return self._pbt_step(state, recent_returns, key)

    # ------------------------------------------------------------------ environments

    def _step_envs(self, env_state: Any, action: jax.Array, keys: jax.Array) -> tuple:
        if self._host_envs:  # `keys` are already their seeds (see _rollout)
            return self.envs.step(env_state, action, seeds=keys)
        return self.envs.step(env_state, action, keys)

    def close(self) -> None:
        """Stops the env worker processes (``env_on='cpu'``, host envs); also done at exit.

        It waits first for the updates already dispatched (JAX runs them asynchronously) to
        finish their env steps: closing under a running update would make it restart them.
        ``with Learner(config) as learner:`` closes it at the end of the block.
        """
        dispatched, self._dispatched = self._dispatched, None
        try:  # a callback's env steps are no effect to wait for; a failed update's: not forever
            wait_for_outputs(dispatched)
        finally:
            self.envs.close()

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_HPARAMS = ("learning_rate", "ent_coef", "clip_coef")


def _explained() -> Any:
    """JAX's unexplained errors of code inside a member (a ``jax.debug.print`` in an env's
    step), explained with how to run that code alone."""
    return explained_errors(
        plain="step its env alone, jax.jit(env.step)(env_state, action, key), or apply its "
        "network alone, learner.network.apply({'params': params}, obs)"
    )


def _normalized(adv: jax.Array) -> jax.Array:
    """``(adv - mean) / (std + 1e-8)``, centred on one of its own values first: advantages that
    are all equal (a minibatch of one-step episodes) then centre to exactly 0, not to float32's
    rounding of their mean, which the division by 1e-8 made a unit-sized advantage."""
    shifted = adv - adv.reshape(-1)[0]
    centred = shifted - shifted.mean()
    return centred / (jnp.sqrt(jnp.mean(centred * centred)) + 1e-8)


def _adam_with_clip(learning_rate: float, max_grad_norm: float) -> optax.GradientTransformation:
    # CleanRL: clip the global grad norm (of this member's gradients), then Adam with eps 1e-5.
    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm), optax.adam(learning_rate, eps=1e-5)
    )


def to_host(metrics: dict) -> dict[str, np.ndarray]:
    """Gathers the (small, per-member scalar) metrics to host numpy arrays."""
    # Collective across processes (members on other hosts' devices); plain device_get otherwise.
    from ensemble.distributed import gather_metrics_to_host

    return gather_metrics_to_host(dict(metrics))


def _episode_stats(
    carry: Rollout, reward: jax.Array, done: jax.Array, info: dict
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The running episodes' return and length after one step, and ``finished`` plus the
    [return, length, count] sums of the episodes it ended.

    On the true reward (what the metrics report): an env's raw ``score`` where its reward is
    clipped, and whole games where a lost life ends a training episode (``episode_goes_on``).
    A host env's restart (after a resume) cuts the running episodes without stepping them: no
    step to count, and an episode it cuts before its first step is no episode.
    """
    restarted = info.get("restarted", jnp.zeros_like(done))
    game_over = done & ~info.get("episode_goes_on", jnp.zeros_like(done)).astype(bool)
    ep_return = carry.ep_return + info.get("score", reward).astype(jnp.float32)
    ep_length = carry.ep_length + (~restarted).astype(jnp.float32)
    ended = game_over & (ep_length > 0)
    finished = carry.finished + jnp.stack(
        [
            jnp.sum(jnp.where(ended, ep_return, 0.0)),
            jnp.sum(jnp.where(ended, ep_length, 0.0)),
            jnp.sum(ended.astype(jnp.float32)),
        ]
    )
    return jnp.where(game_over, 0.0, ep_return), jnp.where(game_over, 0.0, ep_length), finished


def _refuse_donated(state: Any) -> None:
    """A state an earlier update or PBT step donated: with JAX 0.10, a program given a donated
    buffer split over several devices ends the process (a segmentation fault), not an error."""
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            if leaf.is_deleted():
                raise ValueError(
                    "this state was donated to an earlier update (its buffers are gone): pass "
                    "the state that call returned (state, metrics = learner.update(state)); to "
                    "keep an old one, copy it first: jax.tree.map(jnp.copy, state)."
                )


class StateTooLarge(ValueError):
    """The members' state cannot fit in memory (a mistake in ``hidden`` or ``members``)."""


def _refuse_a_state_too_big(network: Any, spec: Any, mesh: Mesh, config: PPOConfig) -> None:
    """Refuses widths whose parameters, gradients and Adam moments cannot fit: on CPU, the OS
    killed the process for memory with no word (``--hidden 100000000``)."""
    obs = jax.ShapeDtypeStruct((1, *spec.obs_shape), jnp.float32)
    # The key made inside the trace: nothing is placed on a device (a transfer guard holds).
    shapes = jax.eval_shape(lambda o: network.init(jax.random.key(0), o), obs)
    per_member = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    have, where, cpu = memory_of(mesh.devices.flat, mesh.local_devices[0])
    if cpu:  # this host's members
        here = config.members * len(mesh.local_devices) // mesh.devices.size
    else:  # one device's members
        here = max(1, config.members // mesh.shape["ensemble"])
    need = 4 * per_member * here  # the parameters, their gradients, Adam's two moments
    if have is not None and need > have:
        raise StateTooLarge(
            f"hidden={tuple(config.hidden)} needs at least {need / 1e9:,.1f} GB for {here} "
            f"member(s)' parameters, gradients and Adam moments, more than the "
            f"{have / 1e9:,.1f} GB of {where}; give narrower hidden layers or fewer members."
        )


def _refuse_an_update_too_big(
    memory: ensemble.CompiledMemory, mesh: Mesh, config: PPOConfig, k: int, live: bool
) -> None:
    """Refuses an update program whose activations cannot fit: the state fitted, and the
    rollout batch x width of every layer then made the OS kill the process with no word
    (``--hidden 4000000``, exit 137) or was a RESOURCE_EXHAUSTED traceback (16777216)."""
    have, where, cpu = memory_of(mesh.devices.flat, mesh.local_devices[0])
    per_device = memory.peak - (memory.argument if live and cpu else 0)  # live: taken already
    need = per_device * (len(mesh.local_devices) if cpu else 1)
    if have is not None and need > have:
        raise StateTooLarge(
            f"an update ({k} per call) of {config.members} member(s) with hidden="
            f"{tuple(config.hidden)} and {config.num_envs} envs x {config.num_steps} steps needs "
            f"about {need / 1e9:,.1f} GB, more than the {have / 1e9:,.1f} GB of {where}; give "
            "narrower hidden layers, fewer members, or fewer envs or steps per update."
        )


def _refuse_debug_nans() -> None:
    """The state and metrics mark 'no episode finished yet' with NaN (``last_return``, the
    ``returns`` of an update where none ended), which ``jax_debug_nans`` raises on."""
    if jax.config.jax_debug_nans:
        raise RuntimeError(
            "rollout.ppo marks 'no episode finished yet' with NaN in its state and metrics, "
            "which jax_debug_nans reports as an error: turn it off around the learner's calls "
            "(with jax.debug_nans(False): ...); jax_debug_infs works."
        )
