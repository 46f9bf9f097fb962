"""Multi-node pre-runs on a Ray cluster: check the cluster, pass the launch's environment to
every rank, and gather each node's memory figures where its logs are written.

`nodes`, `env` and `collect` are pure (no Ray); `ray_api` is the only module that imports Ray,
and only inside its functions: importing pretuner never needs the `ray` extra.
"""
