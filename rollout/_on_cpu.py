"""Work in progress (stub)."""


def on_cpu(*args, **kwargs):  # stub
    raise NotImplementedError("on_cpu")
