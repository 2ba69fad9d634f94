"""Work in progress (stub)."""


def assert_member_axis(*args, **kwargs):  # stub
    raise NotImplementedError("assert_member_axis")


def assert_member_placement(*args, **kwargs):  # stub
    raise NotImplementedError("assert_member_placement")


def assert_no_replicated_members(*args, **kwargs):  # stub
    raise NotImplementedError("assert_no_replicated_members")
