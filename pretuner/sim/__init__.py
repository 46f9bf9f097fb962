"""The emulated Ascend card and vLLM-MindSpore r0.1 server (all memory figures simulated).

`memory` is the physical model, `engine` the scheduler, `http` the OpenAI API, `logs` the real
log formats, `serve` the server's lifecycle, `launcher` the r0.1 wrapper, `npusmi` the device
tool. See `pretuner sim serve --help`.
"""
