"""Values a model, a method= function or a loss reads from outside its arguments (a global, a
closure, a config's field) are read anew by every ensemble call, as by the plain model: a
compiled program kept the first ones before."""

import collections
import collections.abc
import dataclasses
import enum
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax_events import count_compiles

import ensemble

D = 8
HERE = sys.modules[__name__]
SCALE = 1.0  # read by a compact submodule's code
WIDTH = 3  # read by init: the shape of a layer


@dataclasses.dataclass
class Config:
    shift: float = 0.0


CONFIG = Config()


class Scaled(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(x) * SCALE + CONFIG.shift


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Scaled()(nn.Dense(WIDTH)(x))


def members_equal_plain(ens, variables, x, **kwargs):
    out = np.asarray(ens.apply(variables, x, **kwargs))
    for i in range(ens.n):
        want = ens.model.apply(ens.member(variables, i), x, **kwargs)
        np.testing.assert_allclose(out[i], want, rtol=1e-6, atol=1e-7)
    return out


def scaled_after_each(ens, v, x, method, base, changes, atol=0.0):
    """After each ``(change, factor)``: the members equal the plain model, ``factor x base``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the first change's "compiled anew")
        for change, factor in changes:
            change()
            got = members_equal_plain(ens, v, x, method=method)
            np.testing.assert_allclose(got, base * factor, rtol=1e-6, atol=atol)


def test_linen_apply_reads_globals_closures_and_config_fields_anew(monkeypatch):
    x = jnp.arange(8.0).reshape(2, 4)
    ens = ensemble.build(Net(), D)
    v = ens.init(jax.random.key(0), x)
    first = members_equal_plain(ens, v, x)
    with count_compiles() as compiles:
        ens.apply(v, x)
    assert compiles == []  # nothing changed: nothing compiled
    monkeypatch.setattr(HERE, "SCALE", 2.0)
    with pytest.warns(UserWarning, match=r"'SCALE' \(read by Scaled.__call__\) changed"):
        np.testing.assert_allclose(members_equal_plain(ens, v, x), 2 * first, rtol=1e-6)
    monkeypatch.setattr(CONFIG, "shift", 1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once already
        members_equal_plain(ens, v, x)

    temperature = 1.0

    def tempered(module, x):
        return module(x) / temperature

    base = members_equal_plain(ens, v, x, method=tempered)
    temperature = 4.0
    np.testing.assert_allclose(members_equal_plain(ens, v, x, method=tempered), base / 4)


def test_linen_init_reads_a_global_width_anew(monkeypatch):
    x = jnp.ones((2, 4))
    ens = ensemble.build(Net(), D)
    assert ens.init(jax.random.key(0), x)["params"]["Dense_0"]["kernel"].shape == (D, 4, 3)
    monkeypatch.setattr(HERE, "WIDTH", 5)
    with pytest.warns(UserWarning, match=r"ens.init compiled anew: 'WIDTH'"):
        v = ens.init(jax.random.key(0), x)
    assert v["params"]["Dense_0"]["kernel"].shape == (D, 4, 5)
    members_equal_plain(ens, v, x)


BETA = 0.0  # a loss weight annealed between steps


def penalised(params, x):
    out = Net().apply({"params": params}, x)
    return jnp.mean(out**2) + BETA * sum(jnp.sum(p**2) for p in jax.tree.leaves(params))


def test_linen_train_step_reads_an_annealed_loss_weight_anew(monkeypatch):
    x = jnp.arange(8.0).reshape(2, 4) / 8
    ens = ensemble.build(Net(), D)
    params = ens.init(jax.random.key(0), x)["params"]
    plain = [jax.tree.map(lambda a, i=i: np.asarray(a[i]), params) for i in range(D)]
    tx = optax.sgd(0.1)
    step = ens.train_step(penalised, tx)
    opt_state = step.init(params)
    for beta in (0.0, 1.0, 3.0):
        monkeypatch.setattr(HERE, "BETA", beta)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            params, opt_state, _ = step(params, opt_state, x)
        for i, p in enumerate(plain):
            grads = jax.grad(penalised)(p, x)
            plain[i] = optax.apply_updates(p, tx.update(grads, tx.init(p), p)[0])
    for i, p in enumerate(plain):
        got = jax.tree.map(lambda a, i=i: np.asarray(a[i]), params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, p)


class Tempered(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear(x) * SCALE


def test_nnx_call_and_train_step_read_globals_anew(monkeypatch):
    x = jnp.arange(8.0).reshape(2, 4) / 8
    ens = ensemble.build(Tempered, D)
    base = np.asarray(ens(x))
    monkeypatch.setattr(HERE, "SCALE", 3.0)
    with pytest.warns(UserWarning, match=r"the ensemble's call compiled anew: 'SCALE'"):
        out = np.asarray(ens(x))
    np.testing.assert_allclose(out, 3 * base, rtol=1e-6)
    np.testing.assert_allclose(out[5], ens.member(5)(x), rtol=1e-6)

    def loss(module, x):  # reads the global through its module, as `config.beta` would
        return jnp.mean(module(x) ** 2) * HERE.BETA

    plain = [ens.member(i) for i in range(D)]
    step = ens.train_step(loss, optax.sgd(0.1))
    optimizer = step.init()
    for scale, beta in ((1.0, 1.0), (1.0, 2.0), (2.0, 2.0)):
        monkeypatch.setattr(HERE, "SCALE", scale)
        monkeypatch.setattr(HERE, "BETA", beta)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(ens, optimizer, x)
        for m in plain:
            grads = nnx.grad(loss)(m, x)
            nnx.update(m, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(m, nnx.Param), grads))
    for i, m in enumerate(plain):
        np.testing.assert_allclose(ens.member(i)(x), m(x), rtol=1e-5, atol=1e-6)


out = 0  # a global named like the attribute the model reads (self.out): no input of it
TRACES = 0
WEIGHTS = np.ones(2, np.float32)  # mutated in place


class Named(nnx.Module):
    scale = 1.0  # a class attribute

    def __init__(self, rngs, cfg):
        self.out = nnx.Linear(4, 2, rngs=rngs)
        self.cfg = cfg  # a config the module holds, mutated in place

    def __call__(self, x):
        global TRACES
        TRACES += 1  # counts traces: assigned by the code, so no input
        return self.out(x) * self.scale * self.cfg.shift * WEIGHTS


def test_only_what_the_code_reads_is_an_input_and_each_kind_is_read_anew(monkeypatch):
    global out
    x = jnp.arange(8.0).reshape(2, 4) / 8
    cfg = Config(shift=1.0)
    ens = ensemble.build(lambda rngs: Named(rngs, cfg), D)
    base = np.asarray(ens(x))
    with count_compiles() as compiles:
        for _ in range(3):
            out = ens(x)  # rebinds the global `out`; TRACES changed at the trace
    assert compiles == []
    changes = [
        (lambda: monkeypatch.setattr(Named, "scale", 2.0), 2.0),
        (lambda: monkeypatch.setattr(cfg, "shift", 3.0), 6.0),
        (lambda: WEIGHTS.__setitem__(0, 5.0), np.array([30.0, 6.0])),
    ]
    try:
        for change, factor in changes:
            change()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = np.asarray(ens(x))
            np.testing.assert_allclose(got, base * factor, rtol=1e-6)
            np.testing.assert_allclose(got[2], ens.member(2)(x), rtol=1e-6)
    finally:
        WEIGHTS[:] = 1.0


class Trainer:
    """A loss as a bound method of an object that also holds the training state."""

    def __init__(self, model):
        self.model, self.beta, self.params = model, 0.5, None

    def loss(self, params, x):
        return jnp.mean(self.model.apply({"params": params}, x) ** 2) * self.beta


def test_a_bound_method_loss_keys_on_what_it_reads_of_its_object_only():
    x = jnp.arange(8.0).reshape(2, 4) / 8
    trainer = Trainer(Net())
    ens = ensemble.build(Net(), D)
    params = ens.init(jax.random.key(0), x)["params"]
    step = ens.train_step(trainer.loss, optax.sgd(0.1))
    opt_state = step.init(params)
    params, opt_state, _ = step(params, opt_state, x)
    with count_compiles() as compiles:
        for _ in range(3):
            params, opt_state, _ = step(params, opt_state, x)
            trainer.params = params  # held by the object, never read by the loss
    assert compiles == []
    trainer.beta = 2.0  # read by the loss: a new program
    before = jax.tree.map(np.asarray, params)
    with pytest.warns(UserWarning, match=r"'self.beta' \(read by Trainer.loss\) changed"):
        _, _, losses = step(params, opt_state, x)
    for i in range(D):
        want = trainer.loss(jax.tree.map(lambda a, i=i: a[i], before), x)
        np.testing.assert_allclose(losses[i], want, rtol=1e-5)


class Mode(enum.Enum):
    SMALL = 1.0
    BIG = 3.0


class Holder:
    """A config whose field is a property over a private attribute, and one __getattr__ makes
    (as ml_collections' ConfigDict does)."""

    def __init__(self):
        self._beta, self._extra = 1.0, {"gamma": 1.0}

    @property
    def beta(self):
        return self._beta

    def __getattr__(self, name):
        try:
            return self.__dict__["_extra"][name]
        except KeyError:
            raise AttributeError(name) from None


STATS = {"traces": 0}
MODE = Mode.SMALL
HOLDER = Holder()
TABLE = list(range(100_000))  # large: keyed by identity, not walked on every call


def read_many(module, x):
    STATS["traces"] += 1  # a counter the code writes: no input
    return module(x) * MODE.value * HOLDER.beta * HOLDER.gamma * (TABLE[3] - 2)


def test_properties_dynamic_fields_enums_and_counters(monkeypatch):
    x = jnp.ones((2, 4))
    ens = ensemble.build(Net(), D)
    v = ens.init(jax.random.key(0), x)
    base = members_equal_plain(ens, v, x, method=read_many)
    traces = STATS["traces"]
    with count_compiles() as compiles:
        for _ in range(3):
            ens.apply(v, x, method=read_many)
    assert compiles == [] and STATS["traces"] == traces
    changes = [
        (lambda: monkeypatch.setattr(HERE, "MODE", Mode.BIG), 3.0),
        (lambda: monkeypatch.setattr(HOLDER, "_beta", 2.0), 6.0),
        (lambda: monkeypatch.setitem(HOLDER._extra, "gamma", 5.0), 30.0),
    ]
    scaled_after_each(ens, v, x, read_many, base, changes)


# 4,100 values read whole (indexed by a variable): more than one walk looks at (2,048).
SECTIONS = [{"w": 1.0, **{f"k{j}": 0.0 for j in range(40)}} for _ in range(100)]
INDEX = 7
SETTINGS = {f"s{i}": {f"k{j}": 0.0 for j in range(40)} for i in range(60)} | {
    "model": {"scale": 1.0}
}
TASK = Config(shift=1.0)


def tabled(module, x):
    return module(x) * SECTIONS[INDEX]["w"] * SETTINGS["model"]["scale"] * TASK.shift


def test_big_tables_do_not_hide_later_reads(monkeypatch):
    """SETTINGS['model']['scale'] and TASK.shift are read after a table past the walk's budget:
    they are still seen (constant subscripts read only what they name; containers open breadth
    first), and the table is keyed by identity."""
    x = jnp.ones((2, 4))
    ens = ensemble.build(Net(), D)
    v = ens.init(jax.random.key(0), x)
    base = members_equal_plain(ens, v, x, method=tabled)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monkeypatch.setitem(SETTINGS["model"], "scale", 3.0)
        np.testing.assert_allclose(
            members_equal_plain(ens, v, x, method=tabled), 3 * base, rtol=1e-6
        )
        monkeypatch.setattr(TASK, "shift", 2.0)
        np.testing.assert_allclose(
            members_equal_plain(ens, v, x, method=tabled), 6 * base, rtol=1e-6
        )


SEEN = []  # filled by the code at each trace: its own, no input


def logged(module, x):
    SEEN.append(x.shape)
    return module(x)


def test_a_list_the_code_appends_to_is_no_input():
    x = jnp.ones((2, 4))
    ens = ensemble.build(Net(), D)
    v = ens.init(jax.random.key(0), x)
    ens.apply(v, x, method=logged)
    with count_compiles() as compiles:
        for _ in range(3):
            ens.apply(v, x, method=logged)
    assert compiles == [] and len(SEEN) == 1


SCALES = {("enc", 0): 1.0, Mode.SMALL: 1.0}  # keys of any hashable type
MAPPED = collections.UserDict(scale=1.0)


@jax.custom_jvp
def eps_scaled(x):
    return x * SCALE  # a global read inside a custom_jvp function


eps_scaled.defjvp(lambda primals, tangents: (eps_scaled(*primals), tangents[0] * SCALE))


def keyed(module, x):
    return eps_scaled(module(x)) * SCALES[("enc", 0)] * SCALES[Mode.SMALL] * MAPPED["scale"]


def test_tuple_and_enum_keys_mappings_and_wrapped_functions_are_read_anew(monkeypatch):
    x = jnp.ones((2, 4))
    ens = ensemble.build(Net(), D)
    v = ens.init(jax.random.key(0), x)
    base = members_equal_plain(ens, v, x, method=keyed)
    changes = [
        (lambda: monkeypatch.setitem(SCALES, ("enc", 0), 2.0), 2.0),
        (lambda: monkeypatch.setitem(SCALES, Mode.SMALL, 3.0), 6.0),
        (lambda: monkeypatch.setitem(MAPPED, "scale", 5.0), 30.0),
        (lambda: monkeypatch.setattr(HERE, "SCALE", 0.5), 7.5),  # in Scaled and eps_scaled
    ]
    scaled_after_each(ens, v, x, keyed, base, changes)


class Fresh(collections.abc.Mapping):
    """Hands out a new array on every read, as np.load's NpzFile does."""

    def __init__(self, value):
        self.value = value

    def __getitem__(self, key):
        return np.full(4096, self.value, np.float32)

    def __iter__(self):
        return iter(["mean"])

    def __len__(self):
        return 1


class AttrDict(dict):
    __getattr__ = dict.__getitem__  # a missing key is a KeyError, not an AttributeError


class Unhashable(type):
    def __eq__(cls, other):  # makes its classes unhashable
        return cls is other


class Helper(metaclass=Unhashable):
    factor = 1.0


FRESH = Fresh(1.0)
HP = None  # an AttrDict, set by the test (pytest's collection reads module globals' attributes)


def odd(module, x):
    try:
        shift = HP["shift"]
    except KeyError:
        shift = 0.0
    return module(x) * FRESH["mean"][0] * HP.scale * Helper.factor + shift


def test_fresh_arrays_odd_objects_and_classes_compile_once_and_are_read_anew(monkeypatch):
    monkeypatch.setattr(HERE, "HP", AttrDict(scale=1.0))
    x = jnp.ones((2, 4))
    ens = ensemble.build(Net(), D)
    v = ens.init(jax.random.key(0), x)
    base = members_equal_plain(ens, v, x, method=odd)
    with count_compiles() as compiles:
        for _ in range(3):  # a new array of the same contents on every read: one program
            ens.apply(v, x, method=odd)
    assert compiles == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        FRESH.value, HP["scale"] = 2.0, 3.0
        try:
            np.testing.assert_allclose(members_equal_plain(ens, v, x, method=odd), 6 * base)
        finally:
            FRESH.value, HP["scale"] = 1.0, 1.0


class Table:
    def __init__(self):
        self.data = {"k": 1.0}

    def __getitem__(self, key):
        return self.data[key]


class Settings(dict):
    pass


RECORDS = np.zeros(2, dtype=[("w", "f4"), ("o", "O")])  # a structured array with objects
MASKED = np.ma.array([1.0, 2.0], mask=[False, False])
TABLE_OBJ = Table()
SETTINGS_OBJ = Settings()
SETTINGS_OBJ.scale = 1.0  # an attribute of a dict subclass, not a key


def held(module, x):
    records = jnp.asarray(np.array(RECORDS["w"] + 1.0))  # (a fresh array: JAX caches by id)
    weights = jnp.asarray(np.array(MASKED.filled(0.0)))
    return module(x) * records[0] * weights[1] * TABLE_OBJ["k"] * SETTINGS_OBJ.scale


def test_structured_masked_getitem_and_dict_subclass_values_are_read_anew():
    x = jnp.ones((2, 4))
    ens = ensemble.build(Net(), D)
    v = ens.init(jax.random.key(0), x)
    base = members_equal_plain(ens, v, x, method=held)
    changes = [
        (lambda: RECORDS["w"].__setitem__(0, 2.0), 3.0),
        (lambda: TABLE_OBJ.data.__setitem__("k", 2.0), 6.0),
        (lambda: setattr(SETTINGS_OBJ, "scale", 5.0), 30.0),
        (lambda: MASKED.__setitem__(1, np.ma.masked), 0.0),
    ]
    try:
        scaled_after_each(ens, v, x, held, base, changes, atol=1e-7)
    finally:
        RECORDS["w"], TABLE_OBJ.data["k"], SETTINGS_OBJ.scale = 0.0, 1.0, 1.0
        MASKED[1] = 2.0
