"""Work in progress (stub)."""


def train_step(*args, **kwargs):  # stub
    raise NotImplementedError("train_step")
