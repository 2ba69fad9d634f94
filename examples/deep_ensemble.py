"""A deep ensemble on real data: n small networks on scikit-learn's digits, trained at once.

Lakshminarayanan et al. (2017), "Simple and scalable predictive uncertainty estimation using deep
ensembles": members that differ only by their random initialisation and the order they see the
data in, averaged, are better calibrated than any one of them and know better when an input is
unlike anything they were trained on. This script checks both claims on the 8x8 digits dataset
that ships inside scikit-learn (1797 images, 10 classes; no download):

- ``ensemble.build`` makes n members of an MLP on the flattened 64 pixels (``--model cnn``: a
  small CNN), each member initialised from its own key on its own device(s);
- ``ensemble.train_step`` trains all of them in one donated jitted step per batch: every member
  has its own Adam state and its own batch (``--data bootstrap``, the default: its own bootstrap
  resample of the training set, shuffled each epoch; ``--data shuffle``: its own shuffle of the
  whole training set each epoch). ``--val-fraction f`` holds out f of the training digits and
  keeps each member's parameters from its epoch of lowest validation NLL (early stopping);
  the default trains every member for all ``--epochs`` on every training digit;
  ``--adversarial eps`` adds the paper's adversarial training (each batch also moved by ``eps``
  along the sign of its own input gradient);
- each member and the ensemble's mean prediction (the mixture ``mean_i softmax(logits_i)``) are
  scored on held-out test digits: accuracy, negative log-likelihood, expected calibration error
  (15 equal-width confidence bins) and Brier score (summed over classes, in [0, 2]); the
  ensemble's NLL and ECE minus the best member's get a 95% interval from a paired bootstrap
  over the test digits (``--test-resamples``; the best member picked again on each resample),
  which says whether the test set can tell the two apart at all;
- out-of-distribution detection: AUROC for telling test digits (negatives) from shifted inputs
  (positives) by predictive entropy of the mean prediction, by the members' mutual information
  (entropy of the mean minus the mean of the members' entropies), by the variance of the members'
  probabilities and by their disagreement (``ensemble.disagreement``). A single member's own
  predictive entropy is the baseline. The shifted inputs are the same test digits:
  ``rotated`` (90 degrees), ``inverted`` (1 - intensity: a light digit on a dark background),
  ``shuffled`` (each image's pixels permuted at random: the same intensities, no shape) and
  ``noise`` (every pixel uniform in [0, 1]).

Writes to ``--out``: ``deep_ensemble.txt`` (the tables), ``deep_ensemble.json`` (config, every
number) and ``reliability.png`` (reliability diagrams of the member of lowest NLL and the
ensemble, and entropy histograms in and out of distribution).

Run: ``python examples/deep_ensemble.py --out out/deep_ensemble`` (under a minute on 2 cores);
``--help`` lists the options. The metric functions are plain numpy and cross-checked against
``sklearn.metrics`` in ``tests/test_deep_ensemble.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import ensemble
from rollout.ppo._parser import OneLineParser

NUM_CLASSES = 10
SHIFTS = ("rotated", "inverted", "shuffled", "noise")
SCORES = ("entropy", "mutual_info", "variance", "disagreement", "member_entropy")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything the run depends on; the command line is built from these fields."""

    members: int = dataclasses.field(default=8, metadata={"help": "ensemble size n"})
    model: str = dataclasses.field(
        default="mlp", metadata={"help": "network", "choices": ("mlp", "cnn")}
    )
    hidden: int = dataclasses.field(default=256, metadata={"help": "MLP width (CNN dense width)"})
    epochs: int = dataclasses.field(default=150, metadata={"help": "passes over the training set"})
    batch_size: int = dataclasses.field(default=64, metadata={"help": "examples per step"})
    lr: float = dataclasses.field(default=1e-3, metadata={"help": "Adam learning rate"})
    adversarial: float = dataclasses.field(
        default=0.0,
        metadata={
            "help": "adversarial training: the fast-gradient-sign step, in pixel intensity "
            "(pixels are in [0, 1]; 0.01 is the paper's 1%% of the range; 0: off)"
        },
    )
    data: str = dataclasses.field(
        default="bootstrap",
        metadata={"help": "per-member training data", "choices": ("shuffle", "bootstrap")},
    )
    test_fraction: float = dataclasses.field(
        default=0.3, metadata={"help": "share of the digits held out for testing"}
    )
    val_fraction: float = dataclasses.field(
        default=0.0,
        metadata={
            "help": "share of the training digits held out to keep each member's epoch of "
            "lowest validation NLL (0: no split, keep the last epoch)"
        },
    )
    bins: int = dataclasses.field(default=15, metadata={"help": "calibration bins (ECE)"})
    test_resamples: int = dataclasses.field(
        default=2000,
        metadata={
            "help": "bootstrap resamples of the test set for the 95%% intervals of ensemble "
            "minus best member (0: none, else 100 to 100000)"
        },
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of init, split, order"})
    devices: int = dataclasses.field(
        default=0, metadata={"help": "devices to spread the members over (0: as many as fit)"}
    )
    out: str = dataclasses.field(
        default="out/deep_ensemble", metadata={"help": "directory for table, JSON and PNG"}
    )

    def problems(self) -> list[str]:
        """What is wrong with this config, as one line each (empty when it is usable)."""
        out = []
        for name in ("members", "hidden", "epochs", "batch_size", "bins"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.bins > 1000:  # more bins than test rows: ECE is then noise, and memory goes
            out.append(f"--bins must be at most 1000, got {self.bins}")
        if self.test_resamples != 0 and not 100 <= self.test_resamples <= 100_000:
            out.append(f"--test-resamples must be 0 or in [100, 100000], got {self.test_resamples}")
        if not 0 <= self.adversarial <= 0.5:
            out.append(f"--adversarial must be in [0, 0.5], got {self.adversarial}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            out.append(f"--lr must be a positive number, got {self.lr}")
        if not 0.05 <= self.test_fraction <= 0.5:
            out.append(f"--test-fraction must be in [0.05, 0.5], got {self.test_fraction}")
        if not (self.val_fraction == 0 or 0.05 <= self.val_fraction <= 0.5):
            out.append(f"--val-fraction must be 0 or in [0.05, 0.5], got {self.val_fraction}")
        if self.devices < 0:
            out.append(f"--devices must be >= 0, got {self.devices}")
        if not 0 <= self.seed < 2**32:  # scikit-learn's random_state range
            out.append(f"--seed must be in [0, 2**32), got {self.seed}")
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            out.append(f"--out {self.out} is a file; give a folder")
        elif not _writable(self.out):  # found now, not after the training
            out.append(f"--out {self.out} is not a folder this process can write; give another")
        return out


# ---------------------------------------------------------------------------------- data


def _writable(folder: str) -> bool:
    """Whether this process can make ``folder`` and write a file in it (tried, then undone:
    permission bits say little to root, and /proc takes no new folder)."""
    made, path = [], os.path.abspath(folder)
    while not os.path.exists(path):  # the folders makedirs will make, deepest first
        made.append(path)
        path = os.path.dirname(path)
    probe = os.path.join(folder, f".probe-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError:
        return False
    for path in made:  # only those made here
        os.rmdir(path)
    return True


class Data(NamedTuple):
    x_train: np.ndarray  # [N, 64] float32 in [0, 1]
    y_train: np.ndarray  # [N] int32
    x_test: np.ndarray
    y_test: np.ndarray
    x_val: np.ndarray  # held out of the training digits to pick each member's epoch ([0, 64]: none)
    y_val: np.ndarray


def load_digits(test_fraction: float = 0.3, seed: int = 0, val_fraction: float = 0.0) -> Data:
    """scikit-learn's 8x8 digits, intensities scaled to [0, 1], stratified train/test split; then
    ``val_fraction`` of the training digits held out for validation (stratified as well)."""
    try:
        from sklearn.datasets import load_digits as sk_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ValueError(
            "the digits come from scikit-learn: pip install -e '.[examples]'"
        ) from None

    x, y = sk_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y.astype(np.int32), test_size=test_fraction, random_state=seed, stratify=y
    )
    x_va, y_va = x_tr[:0], y_tr[:0]
    if val_fraction > 0:
        x_tr, x_va, y_tr, y_va = train_test_split(
            x_tr, y_tr, test_size=val_fraction, random_state=seed, stratify=y_tr
        )
    return Data(x_tr, y_tr, x_te, y_te, x_va, y_va)


def shifted_inputs(x: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
    """Out-of-distribution versions of flattened 8x8 digits ``x`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    images = x.reshape(-1, 8, 8)
    shuffled = np.take_along_axis(x, rng.permuted(np.tile(np.arange(64), (len(x), 1)), axis=1), 1)
    return {
        "rotated": np.rot90(images, k=1, axes=(1, 2)).reshape(len(x), 64).copy(),
        "inverted": 1.0 - x,
        "shuffled": shuffled,
        "noise": rng.uniform(0.0, 1.0, x.shape).astype(np.float32),
    }


def batch_order(
    n: int, num_train: int, batch_size: int, epochs: int, seed: int, bootstrap: bool
) -> np.ndarray:
    """Training-set indices ``[steps, n, batch_size]``: which examples member i sees at each step.

    Each member draws from its own generator: a fresh shuffle every epoch, of the whole training
    set or (``bootstrap``) of its own resample of it drawn once with replacement. Every epoch has
    ``num_train // batch_size`` steps (the remainder of a shuffle is left out).
    """
    steps = num_train // batch_size
    if steps < 1:
        raise ValueError(f"batch_size {batch_size} exceeds the {num_train} training examples.")
    order = np.empty((epochs, steps, n, batch_size), np.int32)
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        pool = rng.integers(0, num_train, num_train) if bootstrap else np.arange(num_train)
        for e in range(epochs):
            order[e, :, i] = rng.permutation(pool)[: steps * batch_size].reshape(steps, -1)
    return order.reshape(epochs * steps, n, batch_size)


# ---------------------------------------------------------------------------------- models


class MLP(nn.Module):
    """Two hidden ReLU layers on the 64 flattened pixels."""

    hidden: int = 128

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(NUM_CLASSES)(x)


class CNN(nn.Module):
    """Two 3x3 convolutions on the 8x8 image, 2x2 average pooling, one hidden dense layer."""

    hidden: int = 128

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(*x.shape[:-1], 8, 8, 1)
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = x.reshape(*x.shape[:-3], 4, 2, 4, 2, 32).mean((-4, -2))  # 2x2 average pooling
        x = x.reshape(*x.shape[:-3], -1)
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(NUM_CLASSES)(x)


def make_model(cfg: Config) -> nn.Module:
    return CNN(cfg.hidden) if cfg.model == "cnn" else MLP(cfg.hidden)


def check_fits(cfg: Config, num_train: int, pixels: int = 64) -> None:
    """Refuses, in one line, members whose parameters, gradients and Adam moments, with the
    batch order of the run, exceed this host's free memory (``--members 10**20`` failed
    allocating the order in a traceback; ``--hidden 10**11`` in XLA's)."""
    from rollout._devices import available_memory

    model = make_model(cfg)
    image = jax.ShapeDtypeStruct((1, pixels), jnp.float32)
    shapes = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), image)
    per_member = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    order = cfg.epochs * (num_train // cfg.batch_size) * cfg.batch_size * 4  # int32 indices
    need, have = cfg.members * (4 * per_member + order), available_memory()
    if have is not None and need > have:
        raise ValueError(
            f"{cfg.members} member(s) of --hidden {cfg.hidden} over --epochs {cfg.epochs} need "
            f"at least {need / 1e9:,.1f} GB (parameters, gradients, Adam moments, batch order), "
            f"more than this host's {have / 1e9:,.1f} GB free; give fewer or smaller members, or "
            "fewer epochs"
        )


def make_loss(model: nn.Module, adversarial: float = 0.0):
    """The plain loss of ONE member: mean cross-entropy on the examples ``idx`` of ``(x, y)``.

    With ``adversarial = eps > 0``, the paper's adversarial training: plus the cross-entropy of
    the same examples moved by ``eps * sign(d loss / d x)`` (the fast gradient sign method of
    Goodfellow et al. 2015), each member's own direction from its own parameters; no gradient
    flows through the direction.
    """

    def cross_entropy(params: Any, xb: jax.Array, yb: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    def loss_fn(params: Any, idx: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
        xb, yb = x[idx], y[idx]
        if not adversarial:
            return cross_entropy(params, xb, yb)
        # One forward pass gives the clean loss (differentiated in params by the caller) and
        # its input gradient, whose sign is the direction.
        clean, grad_x = jax.value_and_grad(cross_entropy, argnums=1)(params, xb, yb)
        moved = jax.lax.stop_gradient(xb + adversarial * jnp.sign(grad_x))
        return clean + cross_entropy(params, moved, yb)

    return loss_fn


# ---------------------------------------------------------------------------------- training


def pick_devices(n: int, wanted: int = 0) -> list[jax.Device]:
    """``wanted`` devices (0: all of them if n fits them, else the gcd of n and their count)."""
    devices = jax.devices()
    if wanted:
        if wanted > len(devices) or (n % wanted and wanted % n):
            raise ValueError(
                f"--devices {wanted}: need at most {len(devices)} devices, and members ({n}) a "
                "multiple of the devices or the devices a multiple of the members."
            )
        return devices[:wanted]
    d = len(devices)
    return devices[: d if (n % d == 0 or d % n == 0) else math.gcd(n, d)]


def build(cfg: Config, x_sample: np.ndarray) -> tuple[ensemble.LinenEnsemble, Any]:
    """The ensemble and its initial parameters (member i from ``split(key(seed), n)[i]``)."""
    devices = pick_devices(cfg.members, cfg.devices)
    ens = ensemble.build(make_model(cfg), cfg.members, devices=devices)
    params = ens.init(jax.random.key(cfg.seed), jnp.asarray(x_sample[:1]))["params"]
    return ens, params


class Trained(NamedTuple):
    params: Any  # each member's parameters at its best validation epoch (or the last one)
    losses: np.ndarray  # [steps, n] training loss per step and member
    order: np.ndarray  # [steps, n, batch_size] the examples each member saw at each step
    val_nll: np.ndarray  # [epochs, n] each member's validation NLL after each epoch ([0, n]: none)
    best_epoch: np.ndarray  # [n] 1-based epoch whose parameters each member keeps


def member_nll(ens: ensemble.LinenEnsemble, params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """Each member's mean negative log-likelihood on ``(x, y)``: ``[n]``."""
    logits = ens.apply({"params": params}, x)
    labels = jnp.broadcast_to(y, logits.shape[:-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(-1)


@jax.jit
def keep_better(best: Any, params: Any, better: jax.Array) -> Any:
    """Member i of ``params`` where ``better[i]``, else member i of ``best`` (new buffers)."""
    pick = lambda b, p: jnp.where(better.reshape((-1,) + (1,) * (p.ndim - 1)), p, b)
    return jax.tree.map(pick, best, params)


def train(cfg: Config, ens: ensemble.LinenEnsemble, params: Any, data: Data) -> Trained:
    """Trains every member at once for ``cfg.epochs``; with a validation split each member keeps
    its parameters from the epoch with its lowest validation NLL (early stopping, per member).

    ``params`` are donated: use only the returned ones.
    """
    num_train, n = len(data.x_train), cfg.members
    order = batch_order(n, num_train, cfg.batch_size, cfg.epochs, cfg.seed, cfg.data == "bootstrap")
    step = ensemble.train_step(
        make_loss(ens.model, cfg.adversarial),
        optax.adam(cfg.lr),
        n=ens.n,
        mesh=ens.mesh,
        per_member_batch=(True, False, False),
    )
    shared = NamedSharding(ens.mesh, PartitionSpec())  # the training set: on every device once
    x, y, x_val, y_val = jax.device_put(
        (data.x_train, data.y_train, data.x_val, data.y_val), shared
    )
    validate = jax.jit(lambda p: member_nll(ens, p, x_val, y_val))
    opt_state, best = step.init(params), None
    losses, val_nll = [], np.empty((cfg.epochs if len(data.x_val) else 0, n))
    best_epoch = np.full(n, cfg.epochs)
    for epoch, idx in enumerate(np.split(order, cfg.epochs)):
        # One call per epoch: its steps run in one compiled scan (the batches' indices stacked
        # per step, the training set passed once), not one dispatch per step.
        params, opt_state, loss = step.scan(
            params, opt_state, idx, x, y, stacked=(True, False, False)
        )
        losses.append(loss)  # [n, steps]
        if len(val_nll):
            val_nll[epoch] = np.asarray(validate(params))
            better = val_nll[epoch] < np.min(val_nll[:epoch], 0, initial=np.inf)
            best_epoch[better] = epoch + 1
            best = keep_better(params if best is None else best, params, better)
    params = params if best is None else best
    losses = np.concatenate([e.T for e in jax.device_get(losses)])  # [steps, n], on the host
    _check_finite(losses, len(order) // cfg.epochs, best_epoch)
    return Trained(params, losses, order, val_nll, best_epoch)


def _check_finite(losses: np.ndarray, steps_per_epoch: int, kept: np.ndarray) -> None:
    """A diverged member's NaN probabilities scored as an argmax of class 0 and AUROCs of 0.5:
    a table that looked finished. Only the steps up to each member's kept epoch count (early
    stopping keeps a member's parameters from before it diverged)."""
    bad = ~np.isfinite(losses)  # [steps, n]
    bad &= np.arange(len(losses))[:, None] < kept[None, :] * steps_per_epoch
    if bad.any():
        step = int(np.flatnonzero(bad.any(axis=1))[0])
        members = ", ".join(map(str, np.flatnonzero(bad.any(axis=0))))
        raise ValueError(
            f"training diverged: member(s) {members} computed a non-finite loss (first in epoch "
            f"{step // steps_per_epoch + 1}); lower --lr"
        )


# ---------------------------------------------------------------------------------- metrics


def accuracy(probs: np.ndarray, y: np.ndarray) -> float:
    """Share of examples whose most probable class is the label."""
    return float(np.mean(np.argmax(probs, -1) == y))


def nll(probs: np.ndarray, y: np.ndarray) -> float:
    """Mean negative log-probability of the label (natural log)."""
    p = np.take_along_axis(np.asarray(probs, np.float64), y[:, None], -1)[:, 0]
    return float(-np.mean(np.log(np.maximum(p, np.finfo(np.float64).tiny))))


def brier(probs: np.ndarray, y: np.ndarray) -> float:
    """Mean over examples of ``sum_c (p_c - [c == y])^2`` (in [0, 2])."""
    onehot = np.eye(probs.shape[-1])[y]
    return float(np.mean(np.sum((np.asarray(probs, np.float64) - onehot) ** 2, -1)))


def _confidence_bins(probs: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each example's confidence (top class probability), the bin edges and its bin."""
    conf = np.max(probs, -1).astype(np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    return conf, edges, np.clip(np.searchsorted(edges[1:-1], conf, side="left"), 0, bins - 1)


def calibration_bins(probs: np.ndarray, y: np.ndarray, bins: int = 15) -> dict[str, np.ndarray]:
    """Per equal-width confidence bin ``(k/bins, (k+1)/bins]``: count, accuracy, mean confidence.

    Confidence is the top class's probability; empty bins have count 0 and NaN means.
    """
    conf, edges, which = _confidence_bins(probs, bins)
    correct = (np.argmax(probs, -1) == y).astype(np.float64)
    count = np.bincount(which, minlength=bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.bincount(which, correct, bins) / count
        mean_conf = np.bincount(which, conf, bins) / count
    return {"edges": edges, "count": count, "accuracy": acc, "confidence": mean_conf}


def ece(probs: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error: ``sum_b |B_b|/N * |accuracy(B_b) - confidence(B_b)|``."""
    b = calibration_bins(probs, y, bins)
    full = b["count"] > 0
    gaps = np.abs(b["accuracy"][full] - b["confidence"][full])
    return float(np.sum(b["count"][full] * gaps) / np.sum(b["count"]))


def resampled_nll_ece(
    probs: np.ndarray, y: np.ndarray, bins: int, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """NLL and ECE ``[R]`` of ``probs`` on R resamples of the examples at once: resample r
    holds example i ``counts[r, i]`` times (``counts`` ``[R, N]``, rows summing to N)."""
    p = np.take_along_axis(np.asarray(probs, np.float64), y[:, None], -1)[:, 0]
    losses = -np.log(np.maximum(p, np.finfo(np.float64).tiny))
    n = counts.sum(1)
    conf, _, which = _confidence_bins(probs, bins)
    gap = (np.argmax(probs, -1) == y) - conf  # ECE = sum over bins of |sum of gaps| / N
    per_bin = np.zeros((len(y), bins))
    per_bin[np.arange(len(y)), which] = gap
    return counts @ losses / n, np.abs(counts @ per_bin).sum(1) / n


def paired_bootstrap(
    members: np.ndarray, mixture: np.ndarray, y: np.ndarray, bins: int, resamples: int, seed: int
) -> dict[str, dict[str, Any]]:
    """Ensemble minus best member, NLL and ECE, over ``resamples`` bootstrap resamples of the
    test examples (the same resamples for the ensemble and every member; the best member
    picked again on each one, as on the real test set): the difference's 95% percentile
    interval and the share of resamples where the ensemble is below. An interval that holds 0
    means the test set is too small to tell the two apart."""
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(len(y), np.full(len(y), 1.0 / len(y)), size=resamples)
    ens_nll, ens_ece = resampled_nll_ece(mixture, y, bins, counts)
    per_member = [resampled_nll_ece(m, y, bins, counts) for m in members]
    out = {}
    for k, (name, ens) in enumerate((("nll", ens_nll), ("ece", ens_ece))):
        diff = ens - np.min([m[k] for m in per_member], axis=0)
        out[name] = {
            "ci95": [float(np.quantile(diff, 0.025)), float(np.quantile(diff, 0.975))],
            "share_below": float(np.mean(diff < 0)),
        }
    return out


def entropy(probs: np.ndarray) -> np.ndarray:
    """Entropy (nats) of each distribution on the last axis; ``0 log 0 = 0``."""
    p = np.asarray(probs, np.float64)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), -1)


def auroc(negatives: np.ndarray, positives: np.ndarray) -> float:
    """Area under the ROC curve of a score that should be higher for ``positives``.

    The Mann-Whitney form: the chance that a random positive scores above a random negative,
    ties counting one half (ranks of tied scores are averaged).
    """
    scores = np.concatenate([negatives, positives]).astype(np.float64)
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts + 1  # 1-based rank of each distinct value's first copy
    ranks = (first + (counts - 1) / 2.0)[inverse]
    n_neg, n_pos = len(negatives), len(positives)
    return float((ranks[n_neg:].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def classification_metrics(probs: np.ndarray, y: np.ndarray, bins: int) -> dict[str, float]:
    return {
        "accuracy": accuracy(probs, y),
        "nll": nll(probs, y),
        "ece": ece(probs, y, bins),
        "brier": brier(probs, y),
    }


# ---------------------------------------------------------------------------------- evaluation


def predict(ens: ensemble.LinenEnsemble, params: Any, x: np.ndarray) -> dict[str, np.ndarray]:
    """Member probabilities ``[n, N, C]``, the mean prediction ``[N, C]`` and per-example
    uncertainty scores (each higher = less sure)."""
    logits = ens.apply({"params": params}, jnp.asarray(x))
    log_probs = jax.nn.log_softmax(logits, -1)
    members = np.asarray(jnp.exp(log_probs), np.float64)
    mixture = np.asarray(jnp.exp(ensemble.log_mean_exp(log_probs)), np.float64)
    h_members = entropy(members)
    h_mean = entropy(mixture)
    return {
        "members": members,
        "mean": mixture,
        "entropy": h_mean,
        "mutual_info": h_mean - h_members.mean(0),
        "variance": np.asarray(ensemble.variance(jnp.exp(log_probs))).mean(-1),
        "disagreement": np.asarray(ensemble.disagreement(logits)),
        "member_entropy": h_members,
    }


def ood_table(inside: dict[str, np.ndarray], shifted: dict[str, dict]) -> dict[str, dict]:
    """AUROC per score and shift; ``member_entropy`` is the mean over members of each one's own."""
    table: dict[str, dict] = {score: {} for score in SCORES}
    for shift, out in shifted.items():
        for score in SCORES[:-1]:
            table[score][shift] = auroc(inside[score], out[score])
        per_member = [auroc(a, b) for a, b in zip(inside["member_entropy"], out["member_entropy"])]
        table["member_entropy"][shift] = float(np.mean(per_member))
    return table


def evaluate(cfg: Config, ens: ensemble.LinenEnsemble, params: Any, data: Data) -> dict[str, Any]:
    """Every number the report shows (see the module docstring)."""
    inside = predict(ens, params, data.x_test)
    y = data.y_test
    members = [classification_metrics(p, y, cfg.bins) for p in inside["members"]]
    mixture = classification_metrics(inside["mean"], y, cfg.bins)
    best = {k: (min if k != "accuracy" else max)(m[k] for m in members) for k in mixture}
    average = {k: float(np.mean([m[k] for m in members])) for k in mixture}
    shifted = {
        name: predict(ens, params, x) for name, x in shifted_inputs(data.x_test, cfg.seed).items()
    }
    best_nll = int(np.argmin([m["nll"] for m in members]))
    intervals = {}
    if cfg.test_resamples:
        intervals = paired_bootstrap(
            inside["members"], inside["mean"], y, cfg.bins, cfg.test_resamples, cfg.seed
        )
    return {
        "members": members,
        "ensemble": mixture,
        "best_member": best,
        "mean_member": average,
        "goals": {
            "ensemble_nll_below_best_member": mixture["nll"] < best["nll"],
            "ensemble_ece_below_best_member": mixture["ece"] < best["ece"],
        },
        "ensemble_minus_best_member": intervals,
        "ood_auroc": ood_table(inside, shifted),
        "bins": {
            # one member's diagram: the table's "best member" row is each column's best
            f"member {best_nll} (best NLL)": calibration_bins(
                inside["members"][best_nll], y, cfg.bins
            ),
            "ensemble": calibration_bins(inside["mean"], y, cfg.bins),
        },
        "best_nll_member": best_nll,
        "entropies": {"test digits": inside["entropy"]}
        | {k: v["entropy"] for k, v in shifted.items()},
    }


# ---------------------------------------------------------------------------------- report


def format_tables(result: dict[str, Any]) -> str:
    """Metrics per member, their mean, the best value of each column over the members (not one
    member: the best NLL and the best ECE may be two members), the ensemble; then OOD AUROCs."""
    head = f"{'':>14} {'accuracy':>9} {'NLL':>8} {'ECE':>8} {'Brier':>8}"
    row = lambda name, m: (
        f"{name:>14} {m['accuracy']:9.4f} {m['nll']:8.4f} {m['ece']:8.4f} {m['brier']:8.4f}"
    )
    lines = [head] + [row(f"member {i}", m) for i, m in enumerate(result["members"])]
    lines += [row("mean member", result["mean_member"]), row("best member", result["best_member"])]
    lines += [row("ensemble", result["ensemble"])]
    for name, d in result["ensemble_minus_best_member"].items():
        lo, hi = d["ci95"]
        diff = result["ensemble"][name] - result["best_member"][name]
        lines.append(
            f"ensemble - best member, {name.upper()}: {diff:+.4f}, 95% bootstrap interval "
            f"[{lo:+.4f}, {hi:+.4f}], below in {100 * d['share_below']:.0f}% of resamples"
        )
    lines += ["", f"{'OOD AUROC':>14} " + " ".join(f"{s:>9}" for s in SHIFTS)]
    for score, per_shift in result["ood_auroc"].items():
        lines.append(f"{score:>14} " + " ".join(f"{per_shift[s]:9.4f}" for s in SHIFTS))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (name, b) in zip(axes, result["bins"].items()):
        edges, full = b["edges"], b["count"] > 0
        mids = (edges[:-1] + edges[1:]) / 2
        width = edges[1] - edges[0]
        ax.bar(mids[full], b["accuracy"][full], width=width, edgecolor="k", label="accuracy")
        ax.bar(mids[full], b["confidence"][full] - b["accuracy"][full], bottom=b["accuracy"][full],
               width=width, color="tab:red", alpha=0.35, label="gap to confidence")  # fmt: skip
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="accuracy")
        key = "ensemble" if name == "ensemble" else "members"
        metrics = result[key] if key == "ensemble" else result[key][result["best_nll_member"]]
        ax.set_title(f"{name}: ECE {metrics['ece']:.4f}, NLL {metrics['nll']:.4f}")
        ax.legend(loc="upper left")
    ax = axes[2]
    for name, h in result["entropies"].items():
        ax.hist(h, bins=40, range=(0, np.log(NUM_CLASSES)), histtype="step", lw=1.5, label=name)
    ax.set(xlabel="predictive entropy of the ensemble (nats)", ylabel="examples", yscale="log")
    ax.set_title("in distribution vs shifted")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def to_json(obj: Any) -> Any:
    """``obj`` for strict JSON: NaN and infinities (no JSON numbers) become ``null``."""
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_json(v) for v in obj]
    if isinstance(obj, np.ndarray | np.generic):
        return to_json(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


# ---------------------------------------------------------------------------------- CLI


def parse_config(argv: list[str] | None = None) -> Config:
    """``Config`` from the command line: one option per field; bad values exit 2 with one line."""
    parser = OneLineParser(
        description="A deep ensemble on scikit-learn's digits: calibration and OOD detection.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(Config):
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=f.default,
            choices=f.metadata.get("choices"),
            help=f.metadata.get("help"),
        )
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.problems():
        parser.error("; ".join(cfg.problems()))
    return cfg


def run(cfg: Config) -> dict[str, Any]:
    """Trains, evaluates and writes the table, JSON and PNG to ``cfg.out``; returns the report."""
    data = load_digits(cfg.test_fraction, cfg.seed, cfg.val_fraction)
    if cfg.batch_size > len(data.x_train):
        raise ValueError(f"--batch-size must be <= {len(data.x_train)} (the training set)")
    check_fits(cfg, len(data.x_train), data.x_train.shape[1])
    ens, params = build(cfg, data.x_train)
    t0 = time.perf_counter()
    trained = train(cfg, ens, params, data)
    seconds = time.perf_counter() - t0
    result = evaluate(cfg, ens, trained.params, data)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    table = format_tables(result)
    (out / "deep_ensemble.txt").write_text(table + "\n")
    plot(result, out / "reliability.png")
    report = {
        "config": dataclasses.asdict(cfg),
        "devices": [str(d) for d in ens.mesh.devices.flat],
        "train_examples": len(data.x_train),
        "val_examples": len(data.x_val),
        "test_examples": len(data.x_test),
        "train_seconds": seconds,
        "final_train_loss": trained.losses[-1].tolist(),
        "best_epoch": trained.best_epoch,
        "val_nll": trained.val_nll,
    } | {k: v for k, v in result.items() if k not in ("entropies",)}
    text = json.dumps(to_json(report), indent=1, allow_nan=False)
    (out / "deep_ensemble.json").write_text(text + "\n")
    print(table)
    where = f"{len(report['devices'])} device(s)"
    print(f"\n{cfg.members} members on {where}, {seconds:.1f} s training")
    print("goals:", ", ".join(f"{k}={v}" for k, v in result["goals"].items()))
    print(f"wrote {out}/deep_ensemble.txt, deep_ensemble.json, reliability.png")
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(argv)
    try:
        return run(cfg)
    except ValueError as e:  # a config that does not fit the data or the devices
        print(f"deep_ensemble.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    import rollout

    rollout.configure_cpu_devices()  # one CPU device per core (ignored by GPU/TPU backends)
    main()
