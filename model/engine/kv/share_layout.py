"""Where the shared KV tier (kv_share.py) keeps its blocks and how a block's file is laid out.
Torch-free: the prefix router (service/routing/router.py) reads the directory too, to know which
prefixes every replica of the node can load instead of recomputing."""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable

MAGIC = b"QKVKVB01"
HEADER = struct.Struct("<8s32sQI4x")  # magic, block hash, payload bytes, payload CRC32


def namespace(salt: bytes, layout: list[tuple[tuple[int, ...], str]]) -> str:
    """The directory name of an engine's blocks: its salt (model, config, dtype) and each pool's
    block shape and dtype, so that engines whose blocks differ never read each other's."""
    return hashlib.sha256(b"qkv-kv-share:" + salt + repr(layout).encode()).hexdigest()[:32]


def block_file(directory: str, key: bytes) -> str:
    """The file of the block whose prefix hash is `key`."""
    return os.path.join(directory, key.hex())


def leading_files(directory: str, keys: Iterable[bytes]) -> int:
    """How many of `keys`, from the first on, have a block file in `directory`."""
    count = 0
    for key in keys:
        if not os.path.exists(block_file(directory, key)):
            break
        count += 1
    return count
