"""examples/deep_ensemble.py: metrics vs sklearn, members vs single-model training, the CLI."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from subprocess_env import clean_env

sklearn_metrics = pytest.importorskip("sklearn.metrics")

import ensemble  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "deep_ensemble.py"


@pytest.fixture(scope="module")
def de():
    spec = importlib.util.spec_from_file_location("deep_ensemble", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["deep_ensemble"] = module  # linen dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("deep_ensemble", None)


def _random_probs(rng, n=400, classes=10, concentration=0.3):
    return rng.dirichlet(np.full(classes, concentration), n), rng.integers(0, classes, n)


def test_metrics_match_sklearn(de):
    rng = np.random.default_rng(0)
    probs, y = _random_probs(rng)
    labels = np.arange(10)
    assert de.accuracy(probs, y) == pytest.approx(
        sklearn_metrics.accuracy_score(y, probs.argmax(1))
    )
    assert de.nll(probs, y) == pytest.approx(
        sklearn_metrics.log_loss(y, probs, labels=labels), rel=1e-9
    )
    assert de.brier(probs, y) == pytest.approx(
        sklearn_metrics.brier_score_loss(y, probs, labels=labels, scale_by_half=False), rel=1e-9
    )
    scipy_stats = pytest.importorskip("scipy.stats")
    np.testing.assert_allclose(de.entropy(probs), scipy_stats.entropy(probs, axis=1), rtol=1e-9)


@pytest.mark.parametrize("discrete", [False, True])
def test_auroc_matches_sklearn(de, discrete):
    rng = np.random.default_rng(1)
    neg, pos = rng.normal(0, 1, 300), rng.normal(0.7, 1, 200)
    if discrete:  # disagreement-like scores: many ties
        neg, pos = np.round(neg * 2) / 8, np.round(pos * 2) / 8
    labels = np.r_[np.zeros(len(neg)), np.ones(len(pos))]
    expected = sklearn_metrics.roc_auc_score(labels, np.r_[neg, pos])
    assert de.auroc(neg, pos) == pytest.approx(expected, abs=1e-12)
    assert de.auroc(pos, neg) == pytest.approx(1 - expected, abs=1e-12)


def test_ece_hand_computed(de):
    # 4 bins of width 1/4, each bin (lo, hi]: confidences 0.75 and 0.5 sit on bin edges.
    probs = np.array(
        [[0.75, 0.125, 0.125], [0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [0.125, 0.875, 0.0]]
    )
    y = np.array([0, 1, 0, 2])  # right, wrong, right, wrong
    # bin 1: {0.5 wrong} gap 0.5; bin 2: {0.75 right} gap 0.25; bin 3: {1 right, 0.875 wrong}
    # accuracy 0.5, confidence 0.9375, gap 0.4375.  (0.5 + 0.25 + 2 * 0.4375) / 4 = 0.40625
    assert de.ece(probs, y, bins=4) == pytest.approx(0.40625, abs=1e-12)
    b = de.calibration_bins(probs, y, bins=4)
    np.testing.assert_array_equal(b["count"], [0, 1, 1, 2])
    # 15 bins: 20 examples all at confidence 0.95, 16 of them right: |0.8 - 0.95| = 0.15.
    probs = np.tile([0.95, 0.05], (20, 1))
    y = np.r_[np.zeros(16, int), np.ones(4, int)]
    assert de.ece(probs, y, bins=15) == pytest.approx(0.15, abs=1e-12)
    assert de.ece(np.tile([0.5, 0.5], (4, 1)), np.array([0, 0, 1, 1]), 15) == pytest.approx(0.0)


def test_resampled_metrics_equal_the_metrics_on_the_repeated_examples(de):
    # Resample r repeats example i counts[r, i] times: its NLL and ECE must be nll() and ece()
    # of the examples repeated that way (and of the examples themselves for counts of ones).
    rng = np.random.default_rng(3)
    probs, y = _random_probs(rng, n=200)
    counts = np.vstack([np.ones(200, int), rng.multinomial(200, np.full(200, 1 / 200), size=5)])
    got_nll, got_ece = de.resampled_nll_ece(probs, y, 15, counts)
    for r, c in enumerate(counts):
        rep_probs, rep_y = np.repeat(probs, c, axis=0), np.repeat(y, c)
        assert got_nll[r] == pytest.approx(de.nll(rep_probs, rep_y), rel=1e-12)
        assert got_ece[r] == pytest.approx(de.ece(rep_probs, rep_y, 15), rel=1e-12, abs=1e-15)


def test_paired_bootstrap_tells_a_clear_difference_from_none(de):
    rng = np.random.default_rng(4)
    probs, y = _random_probs(rng, n=400)
    sharper = 0.5 * probs + 0.5 * np.eye(10)[y]  # better NLL and calibration on every example
    clear = de.paired_bootstrap(probs[None], sharper, y, 15, 500, seed=0)
    assert clear["nll"]["ci95"][1] < 0 and clear["nll"]["share_below"] == 1.0
    # The ensemble against itself as its only member: never below, interval exactly [0, 0].
    same = de.paired_bootstrap(probs[None], probs, y, 15, 500, seed=0)
    for name in ("nll", "ece"):
        assert same[name] == {"ci95": [0.0, 0.0], "share_below": 0.0}
    # Two members: the best is picked again on every resample, so an ensemble equal to the
    # worse one is never below the best, and above it in NLL on every resample.
    two = de.paired_bootstrap(np.stack([probs, sharper]), probs, y, 15, 500, seed=0)
    assert two["nll"]["ci95"][0] > 0 and two["ece"]["share_below"] == 0.0


def test_batch_order_per_member(de):
    order = de.batch_order(3, 100, 16, 2, seed=0, bootstrap=False)
    assert order.shape == (2 * 6, 3, 16)
    epoch0 = order[:6].transpose(1, 0, 2).reshape(3, -1)
    assert all(len(np.unique(row)) == 96 for row in epoch0)  # a shuffle: no repeats in an epoch
    assert not np.array_equal(epoch0[0], epoch0[1])  # each member its own order
    boot = de.batch_order(3, 100, 16, 1, seed=0, bootstrap=True)[:, 0].ravel()
    assert len(np.unique(boot)) < 90  # a resample drawn with replacement repeats examples
    with pytest.raises(ValueError, match="exceeds"):
        de.batch_order(2, 10, 16, 1, seed=0, bootstrap=False)


def _train_alone(de, cfg, params, data, order_i):
    """Member i the way a single model is trained: plain jitted step, plain optax.adam.
    Returns the parameters after each epoch."""
    loss_fn = de.make_loss(de.make_model(cfg), cfg.adversarial)
    tx = optax.adam(cfg.lr)
    x, y = jnp.asarray(data.x_train), jnp.asarray(data.y_train)

    @jax.jit
    def step(p, s, idx):
        grads = jax.grad(loss_fn)(p, idx, x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    state, per_epoch = tx.init(params), []
    for epoch in np.split(order_i, cfg.epochs):
        for idx in epoch:
            params, state = step(params, state, idx)
        per_epoch.append(params)
    return per_epoch


def _softmax_ce(x, w, b, y):
    """Mean cross-entropy of a linear softmax model and its gradients in x and in (w, b), numpy."""
    logits = x @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    delta = (p - np.eye(w.shape[1])[y]) / len(x)  # d loss / d logits
    loss = -np.log(p[np.arange(len(x)), y]).mean()
    return loss, delta @ w.T, (x.T @ delta, delta.sum(0))


def test_adversarial_loss_equals_numpy_for_a_linear_model(de):
    """Loss and parameter gradient of adversarial training, against the closed form: the batch
    moved by eps * sign(d loss / d x), the moved inputs held fixed in the gradient."""
    import flax.linen as nn

    rng = np.random.default_rng(0)
    x, y = rng.uniform(0, 1, (12, 64)).astype(np.float32), rng.integers(0, 10, 12)
    model = nn.Dense(10)
    params = model.init(jax.random.key(1), x[:1])["params"]
    w, b = (np.asarray(params[k], np.float64) for k in ("kernel", "bias"))
    idx = jnp.arange(12)
    for eps in (0.0, 0.05):
        loss_fn = de.make_loss(model, eps)
        got, grads = jax.value_and_grad(loss_fn)(params, idx, jnp.asarray(x), jnp.asarray(y))
        want, gx, (gw, gb) = _softmax_ce(x.astype(np.float64), w, b, y)
        if eps:
            moved = x + eps * np.sign(gx)
            extra, _, (mw, mb) = _softmax_ce(moved, w, b, y)
            want, gw, gb = want + extra, gw + mw, gb + mb
        np.testing.assert_allclose(float(got), want, rtol=1e-5)
        np.testing.assert_allclose(grads["kernel"], gw, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(grads["bias"], gb, rtol=1e-4, atol=1e-6)


def _close(a, b, i, atol=1e-5):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(u), v[i], atol=atol, rtol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("members,devices", [(4, 2)])  # 2 members per device, 2 devices
@pytest.mark.parametrize("adversarial", [0.0, 0.02])
def test_member_equals_training_alone(de, members, devices, adversarial):
    cfg = de.Config(
        members=members, devices=devices, hidden=32, epochs=2, seed=3, adversarial=adversarial
    )
    data = de.load_digits(cfg.test_fraction, cfg.seed)
    ens, params = de.build(cfg, data.x_train)
    init = jax.device_get(params)  # the step donates params
    trained = de.train(cfg, ens, params, data)
    params, losses, order = trained.params, trained.losses, trained.order
    assert losses.shape == (len(order), members) and np.all(np.isfinite(losses))
    assert trained.val_nll.shape == (0, members) and list(trained.best_epoch) == [2] * members
    final = jax.device_get(params)
    for i in (0, members - 1):
        start = jax.tree.map(lambda a, i=i: a[i], init)
        _close(_train_alone(de, cfg, start, data, order[:, i])[-1], final, i)
    # Members start apart (own init keys) and end apart.
    k = init["Dense_0"]["kernel"]
    assert not np.allclose(k[0], k[1])
    # predict(): member probabilities are the plain model's, the mean is their average.
    pred = de.predict(ens, params, data.x_test[:50])
    plain = ens.model.apply({"params": ensemble.member(params, 1)}, jnp.asarray(data.x_test[:50]))
    np.testing.assert_allclose(pred["members"][1], jax.nn.softmax(plain), atol=1e-6)
    np.testing.assert_allclose(pred["mean"], pred["members"].mean(0), atol=1e-6)
    assert np.all(pred["mutual_info"] > -1e-9)


@pytest.mark.timeout(120)
def test_early_stopping_keeps_each_members_best_epoch(de):
    """Per member: validation NLL after every epoch is the plain model's, and the kept
    parameters are those of the epoch where it was lowest."""
    cfg = de.Config(members=2, devices=2, hidden=16, epochs=4, lr=0.3, val_fraction=0.2, seed=1)
    data = de.load_digits(cfg.test_fraction, cfg.seed, cfg.val_fraction)
    assert len(data.x_val) == 252 and len(data.x_train) + len(data.x_val) == 1257  # ceil(0.2 N)
    assert not set(map(bytes, data.x_val)) & set(map(bytes, data.x_train))
    ens, params = de.build(cfg, data.x_train)
    init = jax.device_get(params)
    trained = de.train(cfg, ens, params, data)
    assert trained.val_nll.shape == (4, 2)
    kept = jax.device_get(trained.params)
    for i in range(2):
        alone = _train_alone(de, cfg, jax.tree.map(lambda a, i=i: a[i], init), data,
                             trained.order[:, i])  # fmt: skip
        for epoch, p in enumerate(alone):
            logits = ens.model.apply({"params": p}, jnp.asarray(data.x_val))
            expected = de.nll(np.asarray(jax.nn.softmax(logits), np.float64), data.y_val)
            assert trained.val_nll[epoch, i] == pytest.approx(expected, abs=1e-4)
        assert trained.best_epoch[i] == np.argmin(trained.val_nll[:, i]) + 1
        _close(alone[trained.best_epoch[i] - 1], kept, i, atol=1e-4)  # lr 0.3: weights ~2
    # lr 0.3 overshoots: some member's best epoch is not its last one.
    assert min(trained.best_epoch) < 4, trained.val_nll


def test_cli_rejects_bad_input(de, capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for argv, message in [
        (["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
        (["--out", str(a_file)], f"--out {a_file} is a file"),
        (["--out", "/proc/no/such"], "--out /proc/no/such is not a folder this process can"),
        (["--members", "0"], "--members must be >= 1"),
        (["--test-fraction", "0.9"], "--test-fraction must be in"),
        (["--model", "resnet"], "invalid choice"),
        (["--val-fraction", "0.9"], "--val-fraction must be 0 or in"),
        (["--test-resamples", "10"], "--test-resamples must be 0 or in [100, 100000], got 10"),
        (["--adversarial", "-0.01"], "--adversarial must be in [0, 0.5], got -0.01"),
        (["--hidden", str(10**11)], "members, or fewer epochs"),  # was a traceback of XLA's
        (["--members", str(10**20)], f"{10**20} member(s) of --hidden 256 over --epochs 150"),
    ]:
        with pytest.raises(SystemExit) as e:
            de.main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        de.main(["--members", "2", "--devices", "3", "--epochs", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--devices 3" in err[0]
    # A diverged run printed a finished-looking table (accuracy 0.1: argmax of NaN rows is
    # class 0; AUROC 0.5 everywhere) and exited 0; it now says so, and writes nothing.
    out = tmp_path / "diverged"
    with pytest.raises(SystemExit) as e:
        de.main(["--members", "2", "--epochs", "1", "--lr", "1e30", "--out", str(out)])
    assert e.value.code == 2 and not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "deep_ensemble.py: error: training diverged: member(s) 0, 1 computed a non-finite loss "
        "(first in epoch 1); lower --lr"
    ]


def test_a_member_that_diverged_after_its_kept_epoch_is_no_divergence(de):
    """Early stopping keeps each member's parameters from its best epoch: a loss that turned
    NaN after it left a finished, finite table, which the divergence check first refused."""
    losses = np.ones((5 * 3, 2))  # 5 epochs of 3 steps, 2 members
    losses[7:, 0] = np.nan  # member 0 diverged in epoch 3
    de._check_finite(losses, 3, np.array([2, 5]))  # it keeps epoch 2
    with pytest.raises(
        ValueError, match=r"member\(s\) 0 computed a non-finite loss \(first in epoch 3"
    ):
        de._check_finite(losses, 3, np.array([3, 5]))


def test_the_report_is_strict_json(de):
    """NaN floats outside arrays (a final loss, a metric) came out as bare NaN tokens."""
    report = {"a": float("nan"), "b": [np.float32(np.inf), 1.5], "c": np.array([np.nan, 2.0])}
    assert json.dumps(de.to_json(report), allow_nan=False) == (
        '{"a": null, "b": [null, 1.5], "c": [null, 2.0]}'
    )


@pytest.mark.timeout(150)
def test_example_runs_end_to_end(tmp_path):
    env = clean_env()
    argv = [
        "--members",
        "2",
        "--epochs",
        "3",
        "--hidden",
        "16",
        "--lr",
        "0.01",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {p.name for p in tmp_path.iterdir()} == {
        "deep_ensemble.txt",
        "deep_ensemble.json",
        "reliability.png",
    }
    report = json.loads((tmp_path / "deep_ensemble.json").read_text())
    assert len(report["members"]) == 2 and report["config"]["epochs"] == 3
    assert set(report["ood_auroc"]["entropy"]) == {"rotated", "inverted", "shuffled", "noise"}
    assert 0.5 < report["ensemble"]["accuracy"] <= 1
    assert "ensemble" in (tmp_path / "deep_ensemble.txt").read_text()
    for name in ("nll", "ece"):  # the default 2000 resamples
        lo, hi = report["ensemble_minus_best_member"][name]["ci95"]
        assert lo <= hi and 0 <= report["ensemble_minus_best_member"][name]["share_below"] <= 1
        assert f"ensemble - best member, {name.upper()}: " in proc.stdout
    assert (tmp_path / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    # The diagram shows one member, named as such: the "best member" row is each column's best.
    assert list(report["bins"]) == [f"member {report['best_nll_member']} (best NLL)", "ensemble"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_step_has_no_cross_device_traffic(de, model):
    """Members split over devices train without collectives (the CNN's plain nn.Conv too)."""
    from jax.sharding import NamedSharding, PartitionSpec

    cfg = de.Config(members=4, devices=2, hidden=16, model=model)
    data = de.load_digits()
    ens, params = de.build(cfg, data.x_train)
    step = ensemble.train_step(
        de.make_loss(ens.model),
        optax.adam(1e-3),
        n=ens.n,
        mesh=ens.mesh,
        per_member_batch=(True, False, False),
    )
    x, y = jax.device_put((data.x_train, data.y_train), NamedSharding(ens.mesh, PartitionSpec()))
    idx = np.zeros((4, 8), np.int32)
    lowered = step.lower(params, step.init(params), idx, x, y)
    assert ensemble.debug.collectives(lowered) == {}
    if model == "cnn":  # the plain convolution is what runs, per device
        assert "convolution(" in lowered.compile().as_text()


def test_missing_scikit_learn_names_the_extra(de, monkeypatch):
    for name in ("sklearn", "sklearn.datasets", "sklearn.model_selection"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ValueError, match=r"scikit-learn: pip install -e '\.\[examples\]'"):
        de.load_digits()
