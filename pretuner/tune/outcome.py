"""Moved to `pretuner.engines.outcome` (engines judge launches; the loop reads the outcome)."""

from pretuner.engines.outcome import Exercised as Exercised
from pretuner.engines.outcome import LaunchOutcome as LaunchOutcome
from pretuner.engines.outcome import OutcomeKind as OutcomeKind
from pretuner.engines.outcome import describe_failure as describe_failure
from pretuner.engines.outcome import tally as tally
from pretuner.engines.outcome import workload as workload
