"""Reads an offline W&B run file (a LevelDB-style log of protobuf records) without W&B's API."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def records(run_dir: Path) -> list[Any]:
    """The records of the one offline W&B run under ``run_dir/wandb``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")
    data, block, pos, raw, buf = path.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B"
    while pos < len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST piece of a record
            raw.append(buf)
            buf = b""
    return [pb.Record.FromString(r) for r in raw]


def history(run_dir: Path) -> list[dict[str, float]]:
    """The logged rows, in order."""
    rows = []
    for record in records(run_dir):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def exit_code(run_dir: Path) -> int | None:
    """The exit code the run finished with (None: it did not finish)."""
    codes = [r.exit.exit_code for r in records(run_dir) if r.WhichOneof("record_type") == "exit"]
    return codes[-1] if codes else None
