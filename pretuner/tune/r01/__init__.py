"""The r0.1 method: a pre-run at the final util, fallbacks, validation under full load."""
