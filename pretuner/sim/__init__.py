"""The emulated cards and servers (all memory figures simulated): one front end, two personalities.

Shared: `argv` (command line), `http` (OpenAI API), `loop` (scheduler base, engine thread),
`state` (what device tools read). The r0.1 personality (Ascend, vLLM-MindSpore) is this
package's `memory`, `engine`, `logs`, `serve`; the V1 one (CUDA, vLLM 0.24) is `v1/`."""
