"""Faulty versions of the digits model, for the rollout tests: each one a real ONNX graph that
onnxruntime loads, with one defect that a rollout gate is meant to catch.

Every function takes the digits model that :func:`mcp_edge.tooling.models.write_digits_onnx`
wrote and writes a copy with the same signature (``input`` float32 [N, 64] ->
``probabilities`` float32 [N, 10]) and a tail of extra nodes behind the digits graph:

- :func:`write_warmup_failing_onnx`: loads, and fails on every run, so the agent's warm-up
  (:func:`mcp_edge.agent.runtime.checks.warm_up`, after the load) is what fails. A ``Reshape``
  of a one-element tensor to ``[1 + 1]`` elements, the ``1`` computed from the input
  (``int(sum(input * 0)) + 1``), so onnxruntime can neither fold it away nor reject it while
  the session is created, and raises when the graph runs.
- :func:`write_erroring_onnx`: answers exactly what digits answers, except that a batch holding
  a row whose first pixel is :data:`ERROR_MARKER` fails: the same ``Reshape``, to
  ``[1 + rows marked]`` elements. Pixels are in [0, 1] and the warm-up's synthetic inputs too,
  so the warm-up passes and only requests made with :func:`marked` fail; the plain digits model
  answers those like any other input.
- :func:`write_slow_onnx`: answers exactly what digits answers after ``repeats`` extra
  ``size`` x ``size`` matrix products (each followed by ``tanh``, so the values stay finite)
  whose sum is multiplied by 0 and added to the probabilities. The product chain starts from
  a constant plus ``sum(input * 0)``, so it depends on the input and runs on every request;
  its cost does not depend on the batch size.

The added zeros leave every probability bit for bit as digits computes it (``p + 0.0 == p``).
A failing ``Reshape`` is onnxruntime's ``FAIL`` status, which the agent reports as a failed
inference (HTTP 500); an out-of-range ``Gather`` would be ``INVALID_ARGUMENT``, which it reads
as the client's bad input (HTTP 400).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from mcp_edge.tooling.models import INPUT_NAME, N_FEATURES, OUTPUT_NAME

ERROR_MARKER = -1.0
"""The first-pixel value that makes :func:`write_erroring_onnx`'s model fail (digits pixels
are in [0, 1])."""
SLOW_SIZE = 384
SLOW_REPEATS = 6
"""The default extra work of :func:`write_slow_onnx`: six 384 x 384 products, about 0.7
GFLOP per run, some 5-15 ms on one core of a server CPU against some 20 µs for digits itself:
a p95 hundreds of times the model's own and, with the agent's queueing and thread hand-over
added to both, still far above any latency gate's ratio."""

_DIGITS_OUTPUT = "digits_probabilities"


def marked(x: npt.ArrayLike, marker: float = ERROR_MARKER) -> npt.NDArray[np.float32]:
    """A float32 copy of the batch ``x`` [N, 64] with every row's first pixel set to
    ``marker``: the input :func:`write_erroring_onnx`'s model fails on."""
    batch = np.array(x, dtype=np.float32, copy=True).reshape(-1, N_FEATURES)
    batch[:, 0] = marker
    return batch


def _digits_with_tail(
    digits_onnx: Path,
    nodes: list[onnx.NodeProto],
    initializers: list[onnx.TensorProto],
    name: str,
) -> onnx.ModelProto:
    """The digits model whose ``probabilities`` are renamed ``digits_probabilities``, followed
    by ``nodes`` (the last of which must write ``probabilities``) and ``initializers``.

    Raises ValueError when ``digits_onnx`` has not digits' signature.
    """
    model = onnx.load(str(digits_onnx))
    graph = model.graph
    if [i.name for i in graph.input] != [INPUT_NAME] or [o.name for o in graph.output] != [
        OUTPUT_NAME
    ]:
        raise ValueError(
            f"{digits_onnx}: expected one input {INPUT_NAME!r} and one output {OUTPUT_NAME!r}"
        )
    producers = [n for n in graph.node if OUTPUT_NAME in n.output]
    if len(producers) != 1:
        raise ValueError(f"{digits_onnx}: {len(producers)} nodes write {OUTPUT_NAME!r}")
    outputs = producers[0].output
    outputs[list(outputs).index(OUTPUT_NAME)] = _DIGITS_OUTPUT
    for node in nodes:  # named after what they write, so errors and profiles name them
        node.name = node.name or node.output[0]
    graph.node.extend(nodes)
    graph.initializer.extend(initializers)
    graph.name = name
    model.producer_name = "mcp_edge.tooling.faulty_models"
    onnx.checker.check_model(model, full_check=True)
    return model


def _input_zero(prefix: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """Nodes computing the float scalar ``sum(input * 0)``: zero, but only known at run time."""
    zero = numpy_helper.from_array(np.array(0.0, np.float32), f"{prefix}_zero_const")
    nodes = [
        helper.make_node("Mul", [INPUT_NAME, zero.name], [f"{prefix}_times_zero"]),
        helper.make_node("ReduceSum", [f"{prefix}_times_zero"], [f"{prefix}_zero"], keepdims=0),
    ]
    return nodes, [zero], f"{prefix}_zero"


def _fail_unless_zero(
    prefix: str, count: str
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes that reshape a one-element tensor to ``[1 + count]`` elements (``count``: an int64
    scalar) and add the sum of the result, zero, to the digits probabilities as
    ``probabilities``: the run fails unless ``count`` is 0."""
    inits = [
        numpy_helper.from_array(np.zeros(1, np.float32), f"{prefix}_one_element"),
        numpy_helper.from_array(np.array(1, np.int64), f"{prefix}_one"),
        numpy_helper.from_array(np.array([0], np.int64), f"{prefix}_axes"),
    ]
    nodes = [
        helper.make_node("Add", [count, f"{prefix}_one"], [f"{prefix}_length"]),
        helper.make_node("Unsqueeze", [f"{prefix}_length", f"{prefix}_axes"], [f"{prefix}_shape"]),
        helper.make_node(
            "Reshape", [f"{prefix}_one_element", f"{prefix}_shape"], [f"{prefix}_reshaped"]
        ),
        helper.make_node("ReduceSum", [f"{prefix}_reshaped"], [f"{prefix}_nothing"], keepdims=0),
        helper.make_node("Add", [_DIGITS_OUTPUT, f"{prefix}_nothing"], [OUTPUT_NAME]),
    ]
    return nodes, inits


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def write_warmup_failing_onnx(digits_onnx: Path, path: Path) -> Path:
    """Write a digits model that loads but fails on every run (so on the agent's warm-up).

    Returns:
        ``path``.
    """
    nodes, inits, zero = _input_zero("fail")
    inits.append(numpy_helper.from_array(np.array(1, np.int64), "fail_offset"))
    nodes += [
        helper.make_node("Cast", [zero], ["fail_zero_int"], to=TensorProto.INT64),
        helper.make_node("Add", ["fail_zero_int", "fail_offset"], ["fail_count"]),
    ]
    tail, tail_inits = _fail_unless_zero("fail", "fail_count")
    model = _digits_with_tail(digits_onnx, nodes + tail, inits + tail_inits, "digits_fails_warmup")
    return _save(model, path)


def write_erroring_onnx(digits_onnx: Path, path: Path, *, marker: float = ERROR_MARKER) -> Path:
    """Write a digits model that fails on any batch holding a row whose first pixel equals
    ``marker`` and answers the rest exactly as digits does.

    Returns:
        ``path``.
    """
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "err_first_pixel"),
        numpy_helper.from_array(np.array(marker, np.float32), "err_marker"),
    ]
    nodes = [
        helper.make_node("Gather", [INPUT_NAME, "err_first_pixel"], ["err_first"], axis=1),
        helper.make_node("Equal", ["err_first", "err_marker"], ["err_hit"]),
        helper.make_node("Cast", ["err_hit"], ["err_hit_int"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["err_hit_int"], ["err_count"], keepdims=0),
    ]
    tail, tail_inits = _fail_unless_zero("err", "err_count")
    model = _digits_with_tail(digits_onnx, nodes + tail, inits + tail_inits, "digits_erroring")
    return _save(model, path)


def write_slow_onnx(
    digits_onnx: Path,
    path: Path,
    *,
    size: int = SLOW_SIZE,
    repeats: int = SLOW_REPEATS,
    seed: int = 0,
) -> Path:
    """Write a digits model that answers exactly as digits does after ``repeats`` extra
    ``size`` x ``size`` matrix products (about ``2 * repeats * size**3`` floating-point
    operations per run, whatever the batch size).

    Returns:
        ``path``.

    Raises:
        ValueError: ``size`` or ``repeats`` is below 1.
    """
    if size < 1 or repeats < 1:
        raise ValueError(f"size and repeats must be at least 1, not {size} and {repeats}")
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(size)
    nodes, inits, zero = _input_zero("slow")
    inits += [
        numpy_helper.from_array(rng.standard_normal((size, size)).astype(np.float32), "slow_start"),
        numpy_helper.from_array(
            (rng.standard_normal((size, size)) * scale).astype(np.float32), "slow_weights"
        ),
    ]
    nodes.append(helper.make_node("Add", ["slow_start", zero], ["slow_m0"]))
    for i in range(repeats):
        nodes += [
            helper.make_node("MatMul", [f"slow_m{i}", "slow_weights"], [f"slow_p{i}"]),
            helper.make_node("Tanh", [f"slow_p{i}"], [f"slow_m{i + 1}"]),
        ]
    nodes += [
        helper.make_node("ReduceSum", [f"slow_m{repeats}"], ["slow_sum"], keepdims=0),
        helper.make_node("Mul", ["slow_sum", "slow_zero_const"], ["slow_nothing"]),
        helper.make_node("Add", [_DIGITS_OUTPUT, "slow_nothing"], [OUTPUT_NAME]),
    ]
    return _save(_digits_with_tail(digits_onnx, nodes, inits, "digits_slow"), path)
