"""Minimal PNG images made here (zlib and struct only, no Pillow, no network): any size, each
one distinct by its uid, cheap to make many of.

An image is a solid colour but for its last row, which is bytes derived from the uid: a
server that hashes the pixels (vLLM's multimodal cache keys) sees every uid as a new image.
Rows after the first use PNG's "Up" filter, so the constant part compresses to almost
nothing; that part is compressed once per size and the compressor's state copied for every
uid, so a 4096 x 4096 image costs a row, not 48 MiB of deflate.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import zlib
from functools import lru_cache

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_SIDE_PX = 16384  # far above any preprocessor's limit; refuses a typo'd 409600
_FILTER_NONE, _FILTER_UP = b"\x00", b"\x02"
_LEVEL = 6


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(
        ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


@lru_cache(maxsize=32)
def _prefix(width: int, height: int) -> tuple[bytes, zlib._Compress]:
    """The compressed rows shared by every image of this size, and the compressor after them."""
    row_bytes = width * 3
    first = _FILTER_NONE + bytes((x * 37 + width + height) % 251 for x in range(row_bytes))
    same = _FILTER_UP + bytes(row_bytes)  # each row repeats the one above it
    c = zlib.compressobj(_LEVEL)
    parts = [c.compress(first)]
    block = same * 64
    rows = height - 2  # the first and the last row are not in the block
    parts += [c.compress(block) for _ in range(rows // 64)]
    parts.append(c.compress(same * (rows % 64)))
    return b"".join(parts), c


def png_bytes(width: int, height: int, uid: str) -> bytes:
    """An RGB PNG of `width` x `height` pixels whose content is unique to `uid`."""
    if not (2 <= width <= MAX_SIDE_PX and 2 <= height <= MAX_SIDE_PX):
        raise ValueError(f"image size {width}x{height} px is outside 2..{MAX_SIDE_PX} px a side")
    head, compressor = _prefix(width, height)
    c = compressor.copy()
    last = _FILTER_NONE + hashlib.shake_256(uid.encode()).digest(width * 3)
    data = head + c.compress(last) + c.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


def png_data_url(width: int, height: int, uid: str) -> str:
    """The image as an OpenAI `image_url` data URL."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height, uid)).decode()


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's header; None when `data` is not a PNG."""
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return (width, height) if width > 0 and height > 0 else None
