"""The edge: the OpenAI-compatible HTTP API over a generation Backend."""
