"""Evaluate exported members: ``python -m rollout.ppo.evaluate DIR [--episodes N] [--seed S]``.

Runs ``N`` deterministic episodes (argmax / mean action) per member of an export written by
:mod:`rollout.ppo.export`, and the same episodes for the ensemble's averaged policy (mean of the
members' action probabilities for discrete actions; for continuous ones, the mean of their
Gaussian means before clipping, then clipped into the action box),
and prints the mean +- std of the episode return for each. Every policy sees the same ``N``
initial states (drawn from ``--seed``), so the rows compare policies, not luck; a pure-JAX
env's step ``t`` of episode ``i`` draws its randomness from ``fold_in(reset key i, t)``.

Episodes of pure-JAX envs (the project's own, ``gymnax:`` and ``brax:`` ids) run all ``N`` at
once, jitted (an ``N`` whose program needs more memory than is free is refused before any
episode runs); ``envpool:`` ids run all ``N`` at once in one EnvPool pool (env ``i`` seeded
``seed + i``, as in training); ``gymnasium:`` ids run in gymnasium, one after another, each
cut after ``--max-steps`` steps if it has not ended (default: the env's own time limit, or
10,000 steps for an env without one). The env
is made with the run's ``--env-kwargs`` (observations that are not a ``Box`` flattened as in
training), so an EnvPool Atari member sees the same preprocessed frames it was trained on.
``--video PATH`` records one episode of the ensemble's policy (of the member, for a single
one) from gymnasium's ``rgb_array`` rendering with imageio; where either is missing it says so
in one line and skips.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rollout.ppo._parser import OneLineParser

Policy = Callable[[Any], Any]


__all__ = [
    "DEFAULT_MAX_STEPS",
    "EnvFailed",
    "build_parser",
    "check_env",
    "ensemble_act",
    "envpool_returns",
    "episode_returns",
    "evaluate",
    "format_table",
    "gymnasium_returns",
    "is_functional",
    "main",
    "make_kwargs",
    "record_video",
    "reset_keys",
    "step_cap",
]


def reset_keys(seed: int, episodes: int) -> Any:
    """The episodes' reset keys: the same for every policy evaluated with ``seed``."""
    import jax

    return jax.random.split(jax.random.key(seed), episodes)


def ensemble_act(members: Sequence[Any]) -> Policy:
    """The ensemble's deterministic policy: argmax of the mean probabilities, or for continuous
    actions the mean of the members' unclipped Gaussian means, clipped into the box (not the
    mean of their clipped actions: the two differ where a member's mean is outside the box)."""

    from rollout.ppo.export import argmax_action

    if members[0].discrete:
        groups = members[0].action_groups
        return lambda obs: argmax_action(sum(m.probs(obs) for m in members) / len(members), groups)
    return lambda obs: members[0].clip_action(sum(m.head(obs) for m in members) / len(members))


def episode_returns(
    policy: Policy,
    env_id: str,
    keys: Any,
    kwargs: dict[str, Any] | None = None,
    max_steps: int | None = None,
) -> np.ndarray:
    """Undiscounted return of one episode per key, all episodes at once: a functional env of
    ``rollout.envs`` (its own, ``gymnax:`` and ``brax:`` ids), made with ``kwargs``; episodes
    end at the env's time limit, or after ``max_steps`` steps if that is sooner."""
    import jax

    env = _functional_env(env_id, kwargs)
    run = jax.jit(lambda keys: _episodes(policy, env, keys, max_steps))
    return np.asarray(run(keys), np.float64)


def _functional_env(env_id: str, kwargs: dict[str, Any] | None) -> Any:
    from rollout import envs

    return envs.make(env_id, auto_reset=False, **(kwargs or {}))


def _episodes(policy: Policy, env: Any, keys: Any, max_steps: int | None) -> Any:
    """Traced: the undiscounted return of one episode per key (see :func:`episode_returns`)."""
    import jax
    import jax.numpy as jnp

    state, obs = jax.vmap(env.reset)(keys)

    def step(carry, t):
        state, obs, total, live = carry
        # A fresh key per step (the env's random dynamics draw anew), the same for every
        # policy evaluated from these reset keys.
        step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, t)
        action = policy(obs)
        state, obs, reward, term, trunc, _ = jax.vmap(env.step)(state, action, step_keys)
        total = total + jnp.where(live, reward.astype(jnp.float32), 0.0)
        return (state, obs, total, live & ~(term | trunc)), None

    start = (state, obs, jnp.zeros(len(keys), jnp.float32), jnp.ones(len(keys), bool))
    limit = env.max_episode_steps if max_steps is None else max_steps
    steps = jnp.arange(1, min(env.max_episode_steps, limit) + 1)
    (_, _, total, _), _ = jax.lax.scan(step, start, steps)
    return total


# Compiled episode runners of exported policies, by what their programs depend on: the env,
# its kwargs, the cap, the members' network / normalisation / action layout. The arrays are
# arguments, so evaluating new members of the same run (a later checkpoint) reuses them.
_RUNNERS: dict[str, Callable[..., Any]] = {}


def _member_returns(members: Sequence[Any], ensemble: bool, env_id: str, keys: Any,
                    kwargs: dict[str, Any], max_steps: int | None) -> np.ndarray:  # fmt: skip
    """:func:`episode_returns` of member ``members[0]`` (or the ensemble policy of all),
    compiled once per runner key (a policy closing over its arrays compiled every call)."""
    run, arrays = _runner(members, ensemble, env_id, kwargs, max_steps)
    return np.asarray(run(arrays, keys), np.float64)


_ANALYSIS_MARGIN = 8


def _refuse_too_many_episodes(members: Sequence[Any], env_id: str, kwargs: dict[str, Any],
                              max_steps: int | None, seed: int, episodes: int) -> None:  # fmt: skip
    """The episodes of a functional env run all at once: refuses a count whose program (the
    ensemble's, the largest) needs more memory than there is (a huge ``--episodes`` was a
    RESOURCE_EXHAUSTED traceback). Only compiles: nothing is allocated."""
    import jax

    from ensemble import compiled_memory
    from rollout._devices import memory_of

    keys = jax.eval_shape(lambda: reset_keys(seed, episodes))
    run, arrays = _runner(members, len(members) > 1, env_id, kwargs, max_steps)
    compiled = run.lower(arrays, keys).compile()  # its errors as the call's would be
    try:
        memory = compiled_memory(compiled)
    except RuntimeError:  # a backend without a memory analysis: nothing to check
        return
    # XLA's own figure for the episodes' scan was 5.1x under what it allocated (CartPole on
    # CPU: 105 against 537 bytes an episode): taken with a margin. The members' arrays (the
    # program's arguments, less the episodes' keys: 8 bytes each) are as large for 1 episode
    # as for many: taken as they are.
    fixed = max(memory.argument - keys.size * 8, 0)
    grows = _ANALYSIS_MARGIN * max(memory.peak - memory.argument, 0) + keys.size * 8
    have, where, _ = memory_of(jax.devices()[:1], jax.devices()[0])
    if have is None or fixed + grows <= have:
        return
    fit = int(episodes * (have - fixed) / grows)
    said = f"{episodes:,} episodes of {env_id} run at once and need about"
    if fit < 1:
        raise ValueError(
            f"{said} {(fixed + grows) / 1e9:,.1f} GB ({fixed / 1e9:,.1f} GB of them the "
            f"members), more than the {have / 1e9:,.1f} GB of {where}; evaluate one member at a "
            "time (give its member_<i> directory) or on a host with more memory."
        )
    raise ValueError(
        f"{said} {(fixed + grows) / 1e9:,.1f} GB, more than the {have / 1e9:,.1f} GB of "
        f"{where}; evaluate fewer episodes (about {fit:,} fit), in several runs with different "
        "seeds if you need more."
    )


def _runner(members: Sequence[Any], ensemble: bool, env_id: str, kwargs: dict[str, Any],
            max_steps: int | None) -> tuple[Callable[..., Any], list[Any]]:  # fmt: skip
    """The jitted episodes of :func:`_member_returns` and the members' arrays it takes."""
    import dataclasses
    import json

    import jax

    layout = [{k: m.meta[k] for k in ("version", "network", "obs_norm", "action")} for m in members]
    key = json.dumps([env_id, kwargs, max_steps, ensemble, layout], sort_keys=True, default=str)
    run = _RUNNERS.get(key)
    if run is None:
        bare = [dataclasses.replace(m, params={}, obs_mean=None, obs_var=None) for m in members]
        env = _functional_env(env_id, kwargs)

        def returns(arrays, keys):
            filled = [dataclasses.replace(m, params=p, obs_mean=mu, obs_var=var)
                      for m, (p, mu, var) in zip(bare, arrays)]  # fmt: skip
            policy = ensemble_act(filled) if ensemble else filled[0].policy_action
            return _episodes(policy, env, keys, max_steps)

        run = _RUNNERS[key] = jax.jit(returns)
        if len(_RUNNERS) > 32:  # many runs evaluated in one process: keep the newest
            del _RUNNERS[next(iter(_RUNNERS))]
    return run, [(m.params, m.obs_mean, m.obs_var) for m in members]


def make_kwargs(meta: dict[str, Any]) -> dict[str, Any]:
    """The env's make kwargs the member was trained with (``--env-kwargs``), less those that
    configured the training's host-env workers (``workers_per_device``, ``timeout``)."""
    from rollout import envs
    from rollout.ppo import PPOConfig

    kwargs = PPOConfig.from_dict(meta.get("config", {})).make_kwargs()
    if str(meta.get("env", "")).startswith(envs.HOST_PREFIXES):
        kwargs = {k: v for k, v in kwargs.items() if k not in envs.HOST_ENV_KWARGS}
    return kwargs


def is_functional(env_id: str) -> bool:
    """Whether ``env_id`` is a pure-JAX env of ``rollout.envs`` (run as one jitted program)."""
    from rollout import envs

    own = {name.lower() for name in envs.ENV_NAMES}
    known = str(env_id).lower() in own or str(env_id).startswith(envs.ENV_PREFIXES)
    return known and not str(env_id).startswith(envs.HOST_PREFIXES)


#: Steps after which an episode of a gymnasium env without a time limit of its own is cut.
DEFAULT_MAX_STEPS = 10_000


def step_cap(env: Any, max_steps: int | None) -> int | None:
    """Steps after which an episode is cut: ``max_steps``, else none where the env has a time
    limit of its own, else :data:`DEFAULT_MAX_STEPS` (a policy that never ends an episode of
    an env without one would otherwise run forever)."""
    if max_steps is not None:
        return max_steps
    spec = getattr(env, "spec", None)
    return None if spec is not None and spec.max_episode_steps else DEFAULT_MAX_STEPS


class EnvFailed(RuntimeError):
    """The env raised during an evaluation episode (its own fault, not the policy's)."""


def _run_episode(env: Any, act: Any, seed: int, cap: int | None, on_step: Any = None) -> tuple:
    """One gymnasium episode of the jitted policy ``act``: (return, whether ``cap`` cut it).
    An exception of the env's ``reset`` / ``step`` is an :class:`EnvFailed` naming the env,
    the episode's seed and the step."""
    name = getattr(getattr(env, "spec", None), "id", None) or type(env).__name__
    try:
        obs, _ = env.reset(seed=seed)
    except Exception as e:
        raise EnvFailed(f"{name} raised {type(e).__name__} in reset(seed={seed}): {e}") from e
    total, done, t = 0.0, False, 0
    while not done:
        if cap is not None and t >= cap:
            return total, True
        action = np.asarray(act(np.asarray(obs, np.float32)[None]))[0]
        try:
            obs, reward, term, trunc, _ = env.step(action)
        except Exception as e:
            raise EnvFailed(
                f"{name} raised {type(e).__name__} at step {t + 1} of the episode of seed "
                f"{seed}: {e}"
            ) from e
        total, done, t = total + float(reward), term or trunc, t + 1
        if on_step is not None:
            on_step()
    return total, False


def gymnasium_returns(
    policy: Policy,
    env_id: str,
    episodes: int,
    seed: int,
    kwargs: dict[str, Any] | None = None,
    max_steps: int | None = None,
    name: str = "the policy",
) -> np.ndarray:
    """Returns of ``episodes`` gymnasium episodes (seeds ``seed``, ``seed + 1``, ...), each
    cut after :func:`step_cap` steps (said on stderr, naming the policy) if it has not ended by
    then."""
    import jax

    from rollout.hostenv._host import make_gymnasium_or_explain

    act = jax.jit(policy)
    env = make_gymnasium_or_explain(env_id, **(kwargs or {}))
    cap = step_cap(env, max_steps)
    try:
        runs = [_run_episode(env, act, seed + e, cap) for e in range(episodes)]
    finally:
        env.close()
    cut = sum(c for _, c in runs)
    if cut:
        print(
            f"note: {name}: {cut} of {episodes} episodes of {env_id} had not ended after {cap} "
            "steps; "
            "their return counts those steps (--max-steps sets the cap)",
            file=sys.stderr,
        )
    return np.asarray([r for r, _ in runs])


def envpool_returns(
    policy: Policy, env_id: str, episodes: int, seed: int, kwargs: dict[str, Any] | None = None
) -> np.ndarray:
    """Returns of the first episode of each of ``episodes`` envs of one EnvPool pool (env
    ``i`` seeded ``seed + i``), stepped together. Atari's ``episodic_life`` and ``reward_clip``
    are training signals: an episode here is a whole game (played as in training, a lost life
    restarting play as EnvPool does), its return the game's raw score."""
    import jax

    from rollout.hostenv._worker import GOES_ON, _EnvPool

    if seed + episodes > 2**31:
        raise ValueError(
            f"EnvPool seeds are int32: seeds {seed}..{seed + episodes - 1} do not fit; "
            f"use a --seed below {2**31 - episodes}"
        )
    act = jax.jit(policy)
    pool = _EnvPool(env_id.removeprefix("envpool:"), dict(kwargs or {}), episodes)
    try:
        obs = pool.reset(seed + np.arange(episodes))  # consecutive: one pool
        total, live = np.zeros(episodes), np.ones(episodes, bool)
        out = (np.empty_like(obs), np.empty(episodes, np.float32), np.empty(episodes, np.uint8),
               np.empty(episodes, bool), np.empty_like(obs))  # fmt: skip
        while live.any():
            pool.step(np.asarray(act(np.asarray(obs, np.float32))), out)
            obs, reward, term, trunc, _ = out
            total += np.where(live, reward, 0.0)
            live &= ~(((term != 0) & ((term & GOES_ON) == 0)) | trunc)  # a lost life plays on
            obs = obs.copy()
        return total
    finally:
        pool.close()


def evaluate(
    members: Sequence[Any], episodes: int, seed: int, max_steps: int | None = None
) -> dict[str, np.ndarray]:
    """Episode returns per policy: ``member_<i>`` for each member, then ``ensemble`` (when
    there are several members). ``max_steps`` cuts episodes sooner than the env's own time
    limit (gymnasium: see :func:`step_cap`); EnvPool ids refuse it (their ``max_episode_steps``
    make kwarg sets the limit)."""
    names = [f"member_{m.meta['member']}" for m in members]
    if len(set(names)) < len(names):  # a row per name: one of them would silently go
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(
            f"evaluate got {twice} more than once (members of different exports?); pass each "
            "member of one export once (python -m rollout.ppo.evaluate checks an export whole)."
        )
    # Indices from 0, as training's envs take them: make_gymnasium adds the space's start.
    policies = dict(zip(names, (m.policy_action for m in members)))
    if len(members) > 1:
        policies["ensemble"] = ensemble_act(members)
    env_id = members[0].meta["env"]
    kwargs = make_kwargs(members[0].meta)
    check_env(members, kwargs)
    if is_functional(env_id):
        _refuse_too_many_episodes(members, env_id, kwargs, max_steps, seed, episodes)
        keys = reset_keys(seed, episodes)
        out = {name: _member_returns([m], False, env_id, keys, kwargs, max_steps)
               for name, m in zip(policies, members)}  # fmt: skip
        if len(members) > 1:
            out["ensemble"] = _member_returns(members, True, env_id, keys, kwargs, max_steps)
        return out
    if str(env_id).startswith("envpool:"):
        if max_steps is not None:
            raise ValueError(
                "--max-steps is not applied to envpool: ids; set EnvPool's own limit when "
                """training (--env-kwargs '{"max_episode_steps": N}')."""
            )
        return {
            name: envpool_returns(p, env_id, episodes, seed, kwargs) for name, p in policies.items()
        }
    env_id = _gymnasium_id(members[0].meta)
    return {
        name: gymnasium_returns(p, env_id, episodes, seed, kwargs, max_steps, name)
        for name, p in policies.items()
    }


def check_env(members: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """The env of ``members[0]`` (made with ``kwargs``) must give the observations and take
    the actions every member's network was exported for: an edited ``env``, or an env whose
    spaces changed since training, would otherwise fail inside the jitted episodes."""
    from rollout import envs
    from rollout.ppo import export
    from rollout.ppo._env import spec_of

    env_id = members[0].meta["env"]
    path = lambda m: getattr(m, "path", None)  # None: a member built in memory
    where = lambda m: path(m) / "member.json" if path(m) else f"member {m.meta['member']}'s meta"
    for m in members:
        if not m.meta.get("env_from_config", True):
            raise ValueError(
                f"{where(m)}: the member trained on an env given to Learner(config, env=...), "
                f"not the one its config makes ({env_id}), so evaluate would score it on "
                "another env; step your env with the member's act() instead (export."
                "read_member)."
            )
    try:
        spec = spec_of(envs.make(env_id, auto_reset=False, **kwargs))
    except ValueError as e:  # unknown, or its library missing: the message says which
        raise ValueError(f"{where(members[0])}: cannot make its env {env_id!r}: {e}") from None

    def says(shape: Any, n: int, discrete: bool, scale: float, groups: Any) -> str:
        pixels = "" if scale == 1 else f" scaled by {scale:.4g}"  # what goes in and out
        acts = f"{n} discrete actions" if discrete else f"{n}-dim continuous actions"
        if groups:
            acts = f"MultiDiscrete actions of nvec {list(groups)}"
        return f"observations {tuple(shape)}{pixels} and {acts}"

    has = says(spec.obs_shape, spec.action_dim, spec.discrete, spec.obs_scale, spec.action_groups)
    full = export.action_box(spec)
    before_4 = {k: v for k, v in full.items() if k != "start"}  # (evaluate's env adds it)
    for m in members:
        box = full if m.meta["version"] >= 4 else before_4
        if m.meta["action"] != box and m.meta["network"]["discrete"] == spec.discrete:
            raise export.NotAnExport(
                f"{where(m)}: field 'action' is {m.meta['action']}, but {env_id}'s action box "
                f"is {box} (edited, or the env changed since training); export the member "
                "again."
            )
        net = m.meta["network"]  # (an MLP has no obs_scale: it takes the env's as it comes)
        scale = net.get("obs_scale", spec.obs_scale)
        takes = says(net["obs_shape"], net["action_dim"], net["discrete"], scale, m.action_groups)
        if takes != has:
            again = (
                export.export_command(path(m).parent)
                if path(m)
                else "python -m rollout.ppo.export RUN_DIR"
            )
            raise export.NotAnExport(
                f"{where(m)}: its network takes {takes}, but {env_id} has {has}: fields 'env' "
                f"and 'network' disagree (edited, or the env changed since training); export "
                f"the member again ({again})."
            )


def _gymnasium_id(meta: dict[str, Any]) -> str:
    """What ``gymnasium.make`` takes for an exported member's env (older exports left
    ``gymnasium_id`` empty for ``gymnasium:<id>`` envs, so it is derived again here)."""
    from rollout.ppo.export import gymnasium_id

    return meta.get("gymnasium_id") or gymnasium_id(meta["env"]) or meta["env"]


def format_table(results: dict[str, np.ndarray]) -> str:
    """One line per policy: name, episodes, mean +- std of the return."""
    lines = [f"{'policy':<12} {'episodes':>8} {'return mean':>12} +- std"]
    for name, returns in results.items():
        lines.append(
            f"{name:<12} {len(returns):>8} {np.mean(returns):>12.2f} +- {np.std(returns):.2f}"
        )
    return "\n".join(lines)


def record_video(
    policy: Policy, meta: dict[str, Any], path: str, seed: int, max_steps: int | None = None
) -> str:
    """Records one gymnasium episode to ``path``; returns a one-line note of what happened."""
    from rollout.ppo.export import gymnasium_id

    if not (meta.get("gymnasium_id") or gymnasium_id(meta["env"])):
        return (
            f"video skipped: {meta['env']} has no gymnasium renderer (videos cover gymnasium:<id> "
            "envs and the CartPole / Pendulum ports)"
        )
    gym_id = _gymnasium_id(meta)
    # gymnasium's classic-control renderer is pygame: no audio and no window needed here.
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    try:
        import imageio.v2 as imageio
        import jax

        from rollout.hostenv._worker import make_gymnasium

        env = make_gymnasium(gym_id, **{**make_kwargs(meta), "render_mode": "rgb_array"})
        env.reset(seed=seed)
        frames = [env.render()]
    except Exception as e:  # gymnasium / imageio / a renderer (pygame) missing
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        missing = isinstance(e, ImportError) or type(e).__name__ == "DependencyNotInstalled"
        fix = "; pip install 'sharded-ensembles[video]'" if missing else ""
        return f"video skipped: cannot render {gym_id} ({type(e).__name__}: {first}){fix}"
    try:  # the episode from the same seed again (its first frame is that one), a frame a step
        _run_episode(env, jax.jit(policy), seed, step_cap(env, max_steps),
                     on_step=lambda: frames.append(env.render()))  # fmt: skip
    finally:
        env.close()
    fps = int(env.metadata.get("render_fps", 30))
    try:
        # GIF takes a frame duration in ms, video formats a frame rate.
        timing = {"duration": 1000 / fps} if path.endswith(".gif") else {"fps": fps}
        imageio.mimsave(path, frames, **timing)
    except Exception as e:  # e.g. .mp4 without imageio-ffmpeg
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"video skipped: cannot write {path} ({first}); try a .gif path"
    return f"video: {path} ({len(frames)} frames)"


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m rollout.ppo.evaluate`` (see the module docstring)."""
    p = OneLineParser(
        prog="python -m rollout.ppo.evaluate",
        description="Deterministic episodes of exported PPO members and of their ensemble.",
    )
    p.add_argument("directory", help="an export (member_<i>/ subdirectories) or one member")
    p.add_argument("--episodes", type=int, default=10, help="episodes per policy (default 10)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the episodes' initial states (default 0)"
    )
    p.add_argument("--video", default=None, help="record one episode (.gif, or .mp4 with ffmpeg)")
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="cut episodes after this many steps (default: the env's own time limit; "
        f"{DEFAULT_MAX_STEPS} for an env without one)",
    )
    return p


def _load(directory: str) -> list[Any]:
    from rollout.ppo import export

    dirs = export.member_dirs(directory)
    members = [export.read_member(p) for p in dirs]
    first = members[0].meta
    seen: dict[Any, Any] = {}
    for path, m in zip(dirs, members):  # a copy would count twice in the ensemble's average
        if m.meta.get("member") in seen:
            raise export.NotAnExport(
                f"{seen[m.meta.get('member')]} and {path} are both member {m.meta.get('member')} "
                "of the run: a copy would count twice in the ensemble; remove one."
            )
        seen[m.meta.get("member")] = path
    for path, m in zip(dirs, members):  # one member's files under another's name
        if path != Path(directory) and path.name != f"member_{m.meta['member']}":
            raise export.NotAnExport(
                f"{path / 'member.json'}: field 'member' is {m.meta['member']} but its directory "
                f"is {path.name}: a member renamed or copied by hand? export the member again "
                f"({export.export_command(path.parent)})."
            )
    for m in members[1:]:
        # One run's checkpoint: same env, network, config and training steps (members exported
        # into one directory from two runs or two checkpoints are not one ensemble).
        for key in ("env", "network", "config", "env_steps", "run_id"):
            if key == "run_id" and export.same_run_id(m.meta.get(key), first.get(key)):
                continue
            if m.meta.get(key) != first.get(key):
                raise export.NotAnExport(
                    f"members {first['member']} and {m.meta['member']} differ in {key!r}, so "
                    "they come from different runs or checkpoints; evaluate members of one "
                    "export together (export again into an empty --to)."
                )
    return members


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m rollout.ppo.evaluate``; 2 on bad input (one line on stderr)."""
    args = build_parser().parse_args(argv)
    for flag, value in (("--episodes", args.episodes), ("--max-steps", args.max_steps)):
        if value is not None and value <= 0:
            print(f"error: {flag} must be positive, got {value}", file=sys.stderr)
            return 2
    if not 0 <= args.seed < 2**32:  # jax.random.key would wrap it onto another seed
        print(f"error: --seed must be in [0, 2**32), got {args.seed}", file=sys.stderr)
        return 2
    video = Path(args.video) if args.video else None
    if video is not None and (video.is_dir() or not video.parent.is_dir()):
        why = "is a directory" if video.is_dir() else f"{video.parent} is not a directory"
        print(f"error: --video {video}: {why}; give a file path such as run.gif", file=sys.stderr)
        return 2
    if not Path(args.directory).exists():
        print(f"error: {args.directory} does not exist; pass an export directory.", file=sys.stderr)
        return 2
    try:
        members = _load(args.directory)
    except ValueError as e:  # NotAnExport
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        results = evaluate(members, args.episodes, args.seed, args.max_steps)
    except ValueError as e:  # --max-steps for an EnvPool id, an env gymnasium cannot make
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EnvFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(results))
    if args.video:
        policy = ensemble_act(members) if len(members) > 1 else members[0].policy_action
        try:
            note = record_video(policy, members[0].meta, args.video, args.seed, args.max_steps)
        except EnvFailed as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    from ensemble._exit import exit_process

    exit_process(main())
