"""The tuning loop behind `pretuner run`: pre-run, derive, fall back, validate, record."""
