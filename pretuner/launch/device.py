"""Moved to `pretuner.devices.npu_table` (the npu-smi table parser)."""

from pretuner.devices.npu_table import NpuCard as NpuCard
from pretuner.devices.npu_table import NpuProcess as NpuProcess
from pretuner.devices.npu_table import decode_output as decode_output
from pretuner.devices.npu_table import free_mib as free_mib
from pretuner.devices.npu_table import parse_npu_processes as parse_npu_processes
from pretuner.devices.npu_table import parse_npu_smi as parse_npu_smi
from pretuner.devices.npu_table import read_npu_smi as read_npu_smi
