"""The policy daemon (``policyd serve``): the Engine behind ZeroMQ ingest, snapshot publishing,
the vLLM KV-event subscriber, the DuckDB history, model checkpoints and an HTTP API.

``start_daemon(settings)`` (``policyd.daemon.server``) runs one in-process; docs/DAEMON.md.
"""
