"""The agent's fleet membership: its MQTT session, telemetry, spool and MQTT inference.

- :mod:`agent.fleet.mqtt`: the one async MQTT 5 adapter (paho-mqtt 2.x, after aiomqtt).
- :mod:`agent.fleet.spool`: the bounded on-disk outbox (SQLite) everything upstream goes through.
- :mod:`agent.fleet.telemetry`: health samples (psutil, tegrastats, RAPL) and inference statistics.
- :mod:`agent.fleet.mqtt_inference`: Open Inference Protocol requests over MQTT 5.
- :mod:`agent.fleet.session`: :class:`~agent.fleet.session.FleetSession`, which ties them together.
- :mod:`agent.fleet.client`: :class:`~agent.fleet.client.InferenceClient` for applications;
  :mod:`agent.fleet.cli`: ``mcp-agent infer``.

Nothing here imports ``controlplane`` or SQLAlchemy.
"""
