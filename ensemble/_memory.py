"""Work in progress (stub)."""


def compiled_memory(*args, **kwargs):  # stub
    raise NotImplementedError("compiled_memory")


def live_memory(*args, **kwargs):  # stub
    raise NotImplementedError("live_memory")


def print_memory(*args, **kwargs):  # stub
    raise NotImplementedError("print_memory")
