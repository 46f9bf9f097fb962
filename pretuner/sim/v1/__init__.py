"""The emulated CUDA card and vLLM 0.24 (V1 engine) server (all memory figures simulated).

`memory` holds every coefficient, `config` the `vllm serve` command line, `boot` the start-up,
`scheduler` and `engine` the V1 step loop, `http` the OpenAI API, `server` the process,
`inproc` the same run in-process, `smi` the emulated nvidia-smi, `truth` what only the
emulator knows. See `python -m pretuner.sim vllm serve --help`.
"""
