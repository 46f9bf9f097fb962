"""Engines as plugins: the `Engine` protocol (`base`), one module per family (`mindspore_r01`,
`vllm_v1`), and the registry that names and picks them (`registry`). An engine's facts (its
command, variables, defaults, log lines, deployment) live here and nowhere else."""
