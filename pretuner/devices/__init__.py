"""Device memory readers: what a card holds right now, sampled during every launch."""

from pretuner.devices.base import DeviceMemory, DeviceReader, DeviceReadError, Sample
from pretuner.devices.selection import select_reader

__all__ = ["DeviceMemory", "DeviceReadError", "DeviceReader", "Sample", "select_reader"]
