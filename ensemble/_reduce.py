"""Work in progress (stub)."""


def disagreement(*args, **kwargs):  # stub
    raise NotImplementedError("disagreement")


def log_mean_exp(*args, **kwargs):  # stub
    raise NotImplementedError("log_mean_exp")


def mean(*args, **kwargs):  # stub
    raise NotImplementedError("mean")


def member(*args, **kwargs):  # stub
    raise NotImplementedError("member")


def variance(*args, **kwargs):  # stub
    raise NotImplementedError("variance")
