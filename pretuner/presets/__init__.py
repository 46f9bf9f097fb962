"""Tuned configurations with their provenance: one JSON file per preset under `data/`."""
