"""Byte units: GiB and MiB are 1024-based everywhere (MindSpore's `M` is MiB, its "GB" GiB)."""

from __future__ import annotations

MIB = 1024**2
GIB = 1024**3
