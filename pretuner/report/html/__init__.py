"""report.html: a self-contained page (inline CSS and SVG, no network) for one run folder."""
