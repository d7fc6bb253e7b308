"""What an offline W&B run holds, read back from its run-<id>.wandb file (wandb 0.31 has no reader of its own).

The file is W&B's header (":W&B", a 2-byte magic, a version byte) then LevelDB's log format: 32 KiB blocks of
records, each a 7-byte header (crc32c, 2-byte little-endian length, type: 1 whole, 2 first, 3 middle, 4 last
piece) and its bytes; a block's tail shorter than a header is padding. A record is a protobuf `Record`."""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data, pos, pieces = path.read_bytes(), HEADER, b""
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # the block's padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + HEADER])
        if kind == 0 and length == 0:  # zero fill at the end of the last block
            break
        pieces += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def history(run_dir: Path) -> dict[int, dict]:
    """step -> {key: value} of every wandb.log call in the run directory's .wandb file (media as their dicts)."""
    (path,) = run_dir.glob("run-*.wandb")
    rows: dict[int, dict] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            rows.setdefault(int(items["_step"]), {}).update(items)
    return rows


def config(run_dir: Path) -> dict:
    (path,) = run_dir.glob("run-*.wandb")
    out = {}
    for record in records(path):
        if record.WhichOneof("record_type") in ("config", "run"):
            cfg = record.config if record.HasField("config") else record.run.config
            out.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in cfg.update})
    return out
