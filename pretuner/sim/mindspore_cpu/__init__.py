"""A small reference server on real MindSpore (CPU) with vLLM-MindSpore r0.1's interface.

A decoder-only network with random weights from the registry's dimensions, the r0.1 KV cache
as a real MindSpore tensor, MindSpore's own pool dump at exit; the card is an address-space
limit (`card.py`)."""
