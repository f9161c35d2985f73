"""Tooling that the demo, the benchmarks and the tests share, installed as ``mcp_edge.tooling``:
a real Mosquitto (with dynamic security) on a free loopback port (:mod:`.mosquitto`), the
digits model trained on scikit-learn's data (:mod:`.models`), and helpers for running the
command-line programs as processes (:mod:`.processes`).

Nothing in the product (``mcp_edge.agent``, ``mcp_edge.controlplane``, ``mcp_edge.shared``)
imports it, and it needs the ``test`` extra (scikit-learn, skl2onnx) for the model helpers.
"""
