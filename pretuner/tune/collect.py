"""Moved to `pretuner.launch.collect` (where a launch's logs are read)."""

from pretuner.launch.collect import CollectedScan as CollectedScan
from pretuner.launch.collect import Collector as Collector
from pretuner.launch.collect import CollectorFactory as CollectorFactory
from pretuner.launch.collect import LocalCollector as LocalCollector
from pretuner.launch.collect import rank_peaks as rank_peaks
