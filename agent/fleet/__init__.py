"""The agent's fleet membership: its MQTT session, telemetry, spool and MQTT inference.

- :mod:`agent.fleet.spool`: the bounded on-disk outbox (SQLite) everything upstream goes through.
- :mod:`agent.fleet.telemetry`: health samples (psutil, tegrastats, RAPL) and inference statistics.
- :mod:`agent.fleet.mqtt_inference`: Open Inference Protocol requests over MQTT 5.
- :mod:`agent.fleet.session`: :class:`~agent.fleet.session.FleetSession`, which ties them together.
- :mod:`agent.fleet.cli`: ``mcp-agent infer`` (through :mod:`mcp_edge.client`).

MQTT goes through the one adapter, :mod:`mcp_edge.shared.mqtt`. Nothing here imports
``agent.update``: :mod:`agent.run` builds the repository transport and hands it in.

Nothing here imports ``controlplane`` or SQLAlchemy.
"""
