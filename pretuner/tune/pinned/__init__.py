"""The pre-run method for V1 engines (pinned KV cache)."""
