"""The emulated CUDA card and vLLM 0.24 (V1 engine) server: `python -m pretuner.sim vllm serve`."""
