"""PPO configuration: one frozen dataclass, CleanRL defaults per environment, checked early.

Every check here runs before anything is compiled, so a bad config fails in milliseconds with a
message that says what to change.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

#: Per-member hyperparameters: a float (all members) or one value per member.
PerMember = float | tuple[float, ...]

#: The hyperparameters that may differ between members.
PER_MEMBER_FIELDS = ("learning_rate", "ent_coef", "clip_coef")

# CleanRL's ppo.py (discrete) and ppo_continuous_action.py defaults, per environment. Pendulum uses
# 8 envs x 256 steps (the same 2048-step batch as CleanRL's 1 x 2048) because short per-env
# rollouts vectorise better, and gamma 0.95 / lr 1e-3 because Pendulum's dense, short-horizon reward
# is the classic case where gamma 0.99 learns slowly (rl-zoo uses 0.9).
_ENV_DEFAULTS: dict[str, dict[str, Any]] = {
    "cartpole": dict(
        num_envs=4,
        num_steps=128,
        update_epochs=4,
        num_minibatches=4,
        learning_rate=2.5e-4,
        gamma=0.99,
        gae_lambda=0.95,
        clip_coef=0.2,
        ent_coef=0.01,
        vf_coef=0.5,
        max_grad_norm=0.5,
        total_steps=500_000,
    ),
    "pendulum": dict(
        num_envs=8,
        num_steps=256,
        update_epochs=10,
        num_minibatches=32,
        learning_rate=1e-3,
        gamma=0.95,
        gae_lambda=0.95,
        clip_coef=0.2,
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
        total_steps=1_000_000,
    ),
    # Other libraries' ids (gymnasium:, envpool:, gymnax:, brax:): CleanRL's ppo.py (discrete
    # actions) and ppo_continuous_action.py (MuJoCo) defaults, picked by the env's action space.
    "discrete": dict(
        num_envs=4,
        num_steps=128,
        update_epochs=4,
        num_minibatches=4,
        learning_rate=2.5e-4,
        ent_coef=0.01,
        total_steps=500_000,
    ),
    "continuous": dict(
        num_envs=1,
        num_steps=2048,
        update_epochs=10,
        num_minibatches=32,
        learning_rate=3e-4,
        ent_coef=0.0,
        total_steps=1_000_000,
    ),
}

# CleanRL's ppo_atari.py (discrete actions on image observations): ppo.py's, with these changes.
_ENV_DEFAULTS["image"] = {
    **_ENV_DEFAULTS["discrete"],
    "num_envs": 8,
    "clip_coef": 0.1,
    "total_steps": 10_000_000,
}

ENV_ALIASES = {
    "cartpole-v1": "cartpole",
    "cartpole": "cartpole",
    "pendulum-v1": "pendulum",
    "pendulum": "pendulum",
    "audio": "audio",
}


def canonical_env_kwargs(value: Any) -> Any:
    """One text per set of make kwargs, so that a run's identity does not depend on spacing or
    key order: a dict, or a string holding a JSON object, -> sorted compact JSON (``''`` for
    none). Anything else passes through for ``validate`` to name.

    >>> canonical_env_kwargs('{"b": 1,  "a": true}'), canonical_env_kwargs({})
    ('{"a": true, "b": 1}', '')
    """
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return value
        value = parsed if isinstance(parsed, dict) else value
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True) if value else ""
    return value


def canonical_env(name: str) -> str:
    """``'CartPole-v1'`` -> ``'cartpole'``; unknown names pass through (checked by ``validate``).

    Ids with a library prefix (``'gymnasium:HalfCheetah-v5'``) are case-sensitive: kept as given.
    """
    if ":" in str(name):
        return str(name)
    return ENV_ALIASES.get(str(name).lower(), str(name).lower())


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Everything one ensemble PPO run needs; ``PPOConfig.for_env`` fills CleanRL's defaults.

    Step counts are per member: ``total_steps`` env steps for each of the ``members`` agents.
    ``learning_rate``, ``ent_coef`` and ``clip_coef`` take a float or one value per member.

    Example:
      >>> cfg = PPOConfig.for_env(
      ...     "cartpole", members=2, total_steps=4096, learning_rate=[3e-4, 1e-3]
      ... )
      >>> cfg.num_updates, cfg.batch_size, cfg.minibatch_size, cfg.per_member("learning_rate")
      (8, 512, 128, (0.0003, 0.001))
    """

    env: str = "cartpole"
    #: Keyword arguments of the env library's make function (``gymnasium.make``,
    #: ``envpool.make``, ``gymnax.make``, ``brax.envs.get_environment``) for ids with a library
    #: prefix, as a JSON object (``for_env`` also takes a dict), e.g.
    #: ``'{"is_slippery": false}'``. Part of the run's identity, like every field.
    env_kwargs: str = ""
    members: int = 4
    total_steps: int = 500_000
    num_envs: int = 4
    num_steps: int = 128
    update_epochs: int = 4
    num_minibatches: int = 4
    learning_rate: PerMember = 2.5e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_coef: PerMember = 0.2
    clip_vloss: bool = True
    ent_coef: PerMember = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    norm_adv: bool = True
    #: Running mean/std observation normalisation per member (None: on for continuous actions
    #: on vector observations; images are scaled to [0, 1] instead).
    normalize_obs: bool | None = None
    #: Reward scaling by the std of the discounted return, per member (None: on for continuous).
    normalize_reward: bool | None = None
    #: On truncation (time limit), add gamma * V(final obs) to the reward instead of treating the
    #: cut as a terminal state (the true final observation comes from the env's ``info``).
    bootstrap_truncation: bool = True
    #: MLP widths for vector observations (images get a conv torso, see ``make_network``).
    hidden: tuple[int, ...] = (64, 64)
    seed: int = 0
    env_on: Literal["device", "cpu"] = "device"
    #: PPO updates per jitted call (a ``lax.scan``): fewer host round trips, one compile. With
    #: ``pbt`` the most per call: each interval is split into calls (``_pbt.call_size``).
    updates_per_call: int = 8
    #: Population-based training (``rollout.ppo._pbt``): every ``pbt_interval`` updates the worst
    #: ``pbt_fraction`` of members (by mean return over the last ``pbt_window`` updates) copy a
    #: top member and multiply its hyperparameters by one of ``pbt_factors``.
    pbt: bool = False
    pbt_interval: int = 10
    pbt_fraction: float = 0.25
    pbt_factors: tuple[float, ...] = (0.8, 1.2)
    pbt_window: int = 3

    @classmethod
    def for_env(cls, env: str = "cartpole", **overrides: Any) -> PPOConfig:
        """CleanRL's defaults for ``env`` (``'cartpole'``, ``'pendulum'``, another library's id
        by its action space), then ``overrides``. For an env of your own, name its family:
        ``'discrete'``, ``'continuous'`` or ``'image'`` (CleanRL's ``ppo.py``,
        ``ppo_continuous_action.py``, ``ppo_atari.py``), and relabel the result.

        >>> import dataclasses
        >>> cfg = dataclasses.replace(PPOConfig.for_env("continuous"), env="reach-v0")
        >>> cfg.learning_rate, cfg.num_steps, cfg.env
        (0.0003, 2048, 'reach-v0')
        """
        name = canonical_env(env)
        if "env_kwargs" in overrides:
            overrides["env_kwargs"] = canonical_env_kwargs(overrides["env_kwargs"])
        base = dict(_ENV_DEFAULTS.get(name, {}))
        if ":" in name:  # another library's id: defaults by action space (builds one env)
            from rollout.ppo._env import env_family

            kwargs = _env_kwargs(name, overrides.get("env_kwargs", ""))
            base = dict(_ENV_DEFAULTS[env_family(name, kwargs)])
        base.update(overrides)
        for key in PER_MEMBER_FIELDS:
            if isinstance(base.get(key), list):
                base[key] = tuple(base[key])
        if isinstance(base.get("pbt_factors"), (list, float)):  # one number: one factor
            base["pbt_factors"] = tuple(_as_list(base["pbt_factors"]))
        if isinstance(base.get("hidden"), list):
            base["hidden"] = tuple(base["hidden"])
        return cls(env=name, **base)

    # Derived sizes -------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Transitions per member per update (``num_envs * num_steps``)."""
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        """Transitions per member per minibatch (``batch_size // num_minibatches``)."""
        return self.batch_size // self.num_minibatches

    @property
    def num_updates(self) -> int:
        """PPO updates in the whole run (``total_steps // batch_size``)."""
        return self.total_steps // self.batch_size

    def make_kwargs(self) -> dict[str, Any]:
        """:attr:`env_kwargs` as a dict (a ``ValueError`` names what is wrong with it)."""
        return _env_kwargs(self.env, self.env_kwargs)

    def per_member(self, name: str) -> tuple[float, ...]:
        """The value of a per-member hyperparameter for each member (length ``members``)."""
        value = getattr(self, name)
        if isinstance(value, (tuple, list)):
            return tuple(float(v) for v in value)
        return (float(value),) * self.members

    def validate(self, num_devices: int | None = None, known_envs: Sequence[str] = ()) -> None:
        """Raises ``ValueError`` naming the first problem; cheap, compiles nothing.

        ``num_devices``: check that ``members`` fits that many devices (``ensemble.layout``).
        ``known_envs``: names the env registry offers (an unknown ``env`` lists them).
        """
        _check_types(self)
        _positive_int(self, "members")
        # A typo, not a run: building its per-member lists would end in a MemoryError.
        if self.members > MAX_MEMBERS:
            raise ValueError(
                f"members={self.members} is more than {MAX_MEMBERS:,} (each member is a PPO agent "
                "with its own envs and optimizer state); give fewer."
            )
        for name in ("total_steps", "num_envs", "num_steps", "update_epochs", "num_minibatches"):
            _positive_int(self, name)
        _positive_int(self, "updates_per_call")
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}.")
        prefix = self.env.partition(":")[0] + ":"
        if known_envs and self.env not in known_envs and prefix not in known_envs:
            raise _unknown_env(self.env, known_envs)
        self.make_kwargs()
        if self.env_on not in ("device", "cpu"):
            raise ValueError(f"env_on must be 'device' or 'cpu', got {self.env_on!r}.")
        from rollout.envs import HOST_PREFIXES

        if self.env_on == "cpu" and self.env.startswith(HOST_PREFIXES):
            raise ValueError(
                f"env_on='cpu' places functional envs; {self.env} runs in CPU worker processes "
                "whatever env_on says: drop env_on / --env-on."
            )
        if self.batch_size % self.num_minibatches:
            raise ValueError(
                f"num_minibatches={self.num_minibatches} must divide the batch "
                f"num_envs*num_steps={self.batch_size}."
            )
        if self.members * self.batch_size > _INT32_MAX:  # a typo: failed once the run began
            raise ValueError(
                f"members*num_envs*num_steps = {self.members * self.batch_size:,} transitions per "
                f"update is more than {_INT32_MAX:,}; give fewer envs or steps."
            )
        if self.num_updates < 1:
            raise ValueError(
                f"total_steps={self.total_steps} is less than one update's batch "
                f"(num_envs*num_steps={self.batch_size}); raise total_steps or shrink the batch."
            )
        # Counted in int32 inside the update (its counter, the lr schedule, the epoch loop).
        for name, value in (("updates", self.num_updates), ("update_epochs", self.update_epochs)):
            if value > _INT32_MAX:
                what = "total_steps / (num_envs*num_steps)" if name == "updates" else name
                raise ValueError(
                    f"{what} = {value:,} is more than the {_INT32_MAX:,} the update counts in "
                    f"int32; give a smaller {'total_steps' if name == 'updates' else name}."
                )
        _check_ranges(self)
        if self.pbt:
            _validate_pbt(self)
        if num_devices is not None:
            from ensemble import layout

            layout(self.members, num_devices)  # its error names n, D and the valid choices

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (tuples become lists); ``PPOConfig.from_dict(d)`` inverts it."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PPOConfig:
        """The config of a :meth:`to_dict` dict (lists back to tuples); other keys are ignored.

        Example:
          >>> cfg = PPOConfig.for_env("pendulum", members=2, learning_rate=[1e-3, 3e-4])
          >>> PPOConfig.from_dict({**cfg.to_dict(), "note": "not a field"}) == cfg
          True
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in fields}
        return cls(**kw)


def _env_kwargs(env: str, text: str) -> dict[str, Any]:
    if not text:
        return {}
    if not isinstance(text, str):
        raise ValueError(
            f"env_kwargs must be a JSON object string such as '{{\"max_episode_steps\": 50}}' "
            f"(PPOConfig.for_env also takes a dict and writes it so), got {text!r}."
        )
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"env_kwargs is not valid JSON ({e.msg}): {text!r}; write an object such as "
            """'{"is_slippery": false}'."""
        ) from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"env_kwargs must be a JSON object (name: value), got {text!r}.")
    if kwargs and ":" not in str(env):
        raise ValueError(
            f"env_kwargs go to the make function of another library's env (gymnasium:, "
            f"envpool:, gymnax:, brax: ids), not to {env!r}."
        )
    return kwargs


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _validate_pbt(cfg: PPOConfig) -> None:
    if cfg.members < 2:
        raise ValueError(f"pbt needs at least 2 members to rank, got members={cfg.members}.")
    _positive_int(cfg, "pbt_interval")
    _positive_int(cfg, "pbt_window")
    if cfg.pbt_interval > cfg.num_updates:
        raise ValueError(
            f"pbt_interval={cfg.pbt_interval} updates is more than the run's {cfg.num_updates} "
            f"updates, so PBT would never act; give at most {cfg.num_updates} (e.g. "
            f"{max(1, cfg.num_updates // 10)}) or raise total_steps."
        )
    f = cfg.pbt_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 0.5:
        raise ValueError(f"pbt_fraction must be in (0, 0.5] (bottom copies top), got {f!r}.")
    if math.floor(f * cfg.members) < 1:
        raise ValueError(
            f"pbt_fraction={f} of members={cfg.members} replaces no member; raise it to at least "
            f"{math.ceil(1000 / cfg.members) / 1000:g}."
        )
    factors = cfg.pbt_factors
    if (
        not isinstance(factors, (tuple, list))
        or not factors
        or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in factors)
        # In float32, as they are applied (1e39 is inf there: 0 x inf made a NaN coefficient).
        or any(not _positive_float32(v) for v in factors)
    ):
        raise ValueError(
            f"pbt_factors must be positive finite float32 numbers like 0.8,1.2, got {factors!r}."
        )


def _finite_float32(v: float) -> bool:
    with np.errstate(over="ignore"):  # 1e39 -> inf: refused by the caller, no warning first
        return bool(np.isfinite(np.float32(v)))


def _positive_float32(v: float) -> bool:
    with np.errstate(over="ignore"):  # 1e39 -> inf: refused below, no warning first
        return bool(np.isfinite(np.float32(v)) and np.float32(v) > 0)


def _unknown_env(env: str, known_envs: Sequence[str]) -> ValueError:
    """The error for an env name nobody knows, with the nearest known name or prefix."""
    import difflib

    names = sorted(k for k in known_envs if not k.endswith(":"))
    prefixes = sorted(k for k in known_envs if k.endswith(":"))
    head, colon, rest = env.partition(":")
    if colon:  # a misspelt library prefix: suggest the id with the right one
        close = [c + rest for c in difflib.get_close_matches(head + ":", prefixes, n=1)]
    else:
        close = difflib.get_close_matches(env.lower(), names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    ids = ", ".join(f"{p}<id>" for p in prefixes)
    return ValueError(f"unknown env {env!r}; {hint}known envs: {', '.join(names)}, or {ids}.")


#: The most members a config takes (far more than any run: beyond it, a typo).
MAX_MEMBERS = 2**20
MAX_WIDTH = 2**24  # units of one hidden layer
_INT32_MAX = 2**31 - 1


def _positive_int(cfg: PPOConfig, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


_BOOLS = ("anneal_lr", "clip_vloss", "norm_adv", "bootstrap_truncation", "pbt")
_MAYBE_BOOLS = ("normalize_obs", "normalize_reward")
_FLOATS = ("gamma", "gae_lambda", "vf_coef", "max_grad_norm", "pbt_fraction")


def _check_ranges(cfg: PPOConfig) -> None:
    """The hyperparameters' values: per-member lengths, signs, finiteness, widths."""
    for name in PER_MEMBER_FIELDS:
        value = getattr(cfg, name)
        if isinstance(value, (tuple, list)) and len(value) != cfg.members:
            raise ValueError(
                f"{name} has {len(value)} values but there are members={cfg.members}; give "
                "one value per member or a single float."
            )
        values = cfg.per_member(name)
        # Finite in float32, as they are applied (1e308 became inf, and the run diverged).
        if any(not _finite_float32(v) or v < 0 for v in values):
            raise ValueError(f"{name} must be finite and >= 0 (in float32), got {value!r}.")
    if any(not _positive_float32(v) for v in cfg.per_member("learning_rate")):  # 1e-46: 0
        raise ValueError(f"learning_rate must be > 0 (in float32), got {cfg.learning_rate!r}.")
    for name in ("gamma", "gae_lambda"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {getattr(cfg, name)!r}.")
    if not _positive_float32(cfg.max_grad_norm):
        raise ValueError(
            f"max_grad_norm must be finite and > 0 (in float32), got {cfg.max_grad_norm!r}."
        )
    if not (_finite_float32(cfg.vf_coef) and cfg.vf_coef >= 0):
        raise ValueError(f"vf_coef must be finite and >= 0 (in float32), got {cfg.vf_coef!r}.")
    hidden = cfg.hidden
    if (
        not isinstance(hidden, tuple | list)
        or not hidden
        or any(isinstance(h, bool) or not isinstance(h, int) or h <= 0 for h in hidden)
    ):
        raise ValueError(f"hidden must be a non-empty tuple of positive ints, got {hidden!r}")
    if max(hidden) > MAX_WIDTH:  # a typo: past int64 it failed in an OverflowError, exit 1
        raise ValueError(f"hidden={hidden!r}: layers of at most {MAX_WIDTH:,} units; give fewer.")


def _check_types(cfg: PPOConfig) -> None:
    """Fields of the wrong Python type, named before any number is read (a string "no" is
    truthy, a NumPy int cannot be written to run.json)."""
    for name in dataclasses.fields(cfg):
        value = getattr(cfg, name.name)
        if isinstance(value, np.generic):
            raise TypeError(
                f"{name.name} is a NumPy {type(value).__name__} ({value!r}); give a Python "
                f"value, e.g. {name.name}={value.item()!r}."
            )
    for name in _BOOLS + _MAYBE_BOOLS:
        value = getattr(cfg, name)
        if not (isinstance(value, bool) or (value is None and name in _MAYBE_BOOLS)):
            raise TypeError(f"{name} must be True or False, got {value!r}.")
    number = lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    for name in _FLOATS:
        if not number(getattr(cfg, name)):
            raise TypeError(f"{name} must be a number, got {getattr(cfg, name)!r}.")
    for name in PER_MEMBER_FIELDS:
        value = getattr(cfg, name)
        values = value if isinstance(value, tuple | list) else (value,)
        if not values or not all(number(v) for v in values):
            raise TypeError(f"{name} must be a number or one number per member, got {value!r}.")
