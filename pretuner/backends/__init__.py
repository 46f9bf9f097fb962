"""Servers pretuner can drive besides vLLM-MindSpore and the emulated card."""
