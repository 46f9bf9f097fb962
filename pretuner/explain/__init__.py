"""`pretuner explain FLAG`: what each memory flag really does, with a run's figure beside it."""

from pretuner.explain.flags import FLAGS, FlagDoc, find
from pretuner.explain.measured import measured_lines, report_section

__all__ = ["FLAGS", "FlagDoc", "find", "measured_lines", "report_section"]
