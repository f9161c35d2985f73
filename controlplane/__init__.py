"""The MCP Edge control plane: REST API, web UI, repository, rollouts, telemetry ingest."""

__version__ = "0.1.0"
