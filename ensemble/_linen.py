"""Work in progress (stub)."""


class LinenEnsemble:  # stub
    pass
