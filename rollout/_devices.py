"""Work in progress (stub)."""


def configure_cpu_devices(*args, **kwargs):  # stub
    raise NotImplementedError("configure_cpu_devices")
