"""Work in progress (stub)."""


class NNXEnsemble:  # stub
    pass


def nnx_optimizer(*args, **kwargs):  # stub
    raise NotImplementedError("nnx_optimizer")


def nnx_train_step(*args, **kwargs):  # stub
    raise NotImplementedError("nnx_train_step")
