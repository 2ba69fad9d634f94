"""Work in progress (stub)."""


def build(*args, **kwargs):  # stub
    raise NotImplementedError("build")
