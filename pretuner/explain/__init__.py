"""`pretuner explain FLAG`: what each memory flag really does, with a run's figure beside it."""
