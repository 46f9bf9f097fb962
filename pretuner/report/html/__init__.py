"""report.html: a self-contained page (inline CSS and SVG, no network) for one run folder."""

from pretuner.report.html.page import PAGE, render_html, write_html

__all__ = ["PAGE", "render_html", "write_html"]
