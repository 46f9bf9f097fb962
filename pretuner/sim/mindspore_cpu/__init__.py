"""A small reference server on real MindSpore (CPU) with vLLM-MindSpore r0.1's interface.

`python -m pretuner.sim.mindspore_cpu serve --model tiny-llama ...` takes the emulated
server's command line and environment, builds a small decoder-only network with random weights
from the registry's dimensions, allocates the r0.1 KV cache as a real MindSpore tensor, runs
real prefills and decode steps, and lets MindSpore print its own pool dump at exit. The card is
an address-space limit (see `card.py`).
"""
