"""pretuner: measure an LLM server's memory and derive the largest safe configuration."""

__version__ = "0.1.0"
