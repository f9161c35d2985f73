"""The agent's serving path: a request in, the model's answer (or a structured error) out.

- :mod:`.serve`: ``mcp-agent serve``: loads the models, runs the HTTP server until stopped.
- :mod:`.model_dir`: the files under ``--model-path`` → loaded models, with hot reload.
- :mod:`.http_api`: the HTTP app (Open Inference Protocol v2, ``/v1/infer``, health, metrics).
- :mod:`.requests`: what every transport shares: request options, the error type and the
  mapping of failures to error codes (the MQTT inference topics use it too).
- :mod:`.tensor_io`: Open Inference Protocol bodies ↔ model feeds and answer bytes.
- :mod:`.preprocess`: ``/v1/infer`` images and numbers → model input, top-k out.
- :mod:`.metrics`, :mod:`.loop_metrics`: the Prometheus families of ``GET /metrics``.

Models run in :mod:`mcp_edge.agent.runtime`; this package imports it, never the reverse,
except that the model manager records into :class:`.metrics.AgentMetrics`. Nothing is
imported here so that importing one module does not import the others.
"""
