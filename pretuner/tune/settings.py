"""What one launch is started with: the r0.1 engine's command facts and the launch data,
re-exported from `pretuner.engines` for the loop's modules."""

from __future__ import annotations

from pretuner.engines.base import LaunchCommand as LaunchCommand
from pretuner.engines.base import LaunchSettings as LaunchSettings
from pretuner.engines.base import Purpose as Purpose
from pretuner.engines.mindspore_r01 import CHUNKED_BY_DEFAULT_ABOVE as CHUNKED_BY_DEFAULT_ABOVE
from pretuner.engines.mindspore_r01 import R01_COMMAND as R01_COMMAND
from pretuner.engines.mindspore_r01 import V03_COMMAND as V03_COMMAND
from pretuner.engines.mindspore_r01 import Backend as Backend
from pretuner.engines.mindspore_r01 import _version_tuple as _version_tuple
from pretuner.engines.mindspore_r01 import build_launch as build_launch
from pretuner.engines.mindspore_r01 import chunked_prefill_flag as chunked_prefill_flag
from pretuner.engines.mindspore_r01 import default_serve_command as default_serve_command
from pretuner.engines.mindspore_r01 import engine_prefill_flags as engine_prefill_flags
from pretuner.engines.mindspore_r01 import server_kv_cache_dtype as server_kv_cache_dtype
