"""Faulty versions of the digits model, for the rollout tests: each one a real ONNX graph that
onnxruntime loads, with one defect that a rollout gate is meant to catch.

Every function takes the digits model that :func:`mcp_edge.tooling.models.write_digits_onnx`
wrote (or one these functions wrote: an erroring version of a slowed model is fine) and writes
a copy with the same signature (``input`` float32 [N, 64] -> ``probabilities`` float32
[N, 10]) and a tail of extra nodes behind its graph:

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

from collections.abc import Callable
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

Tail = tuple[list[onnx.NodeProto], list[onnx.TensorProto]]
"""The nodes and initializers a writer adds behind the model it starts from."""


def marked(x: npt.ArrayLike, marker: float = ERROR_MARKER) -> npt.NDArray[np.float32]:
    """A float32 copy of the batch ``x`` [N, 64] with every row's first pixel set to
    ``marker``: the input :func:`write_erroring_onnx`'s model fails on."""
    batch = np.array(x, dtype=np.float32, copy=True).reshape(-1, N_FEATURES)
    batch[:, 0] = marker
    return batch


def _fresh_prefix(graph: onnx.GraphProto, prefix: str) -> str:
    """``prefix``, or ``prefix2``, ``prefix3``...: the first that no tensor or node of
    ``graph`` starts with (so writers can be applied to each other's models)."""
    names = {i.name for i in graph.initializer} | {n.name for n in graph.node}
    names |= {o for n in graph.node for o in n.output}
    candidate, n = prefix, 1
    while any(name.startswith(f"{candidate}_") for name in names):
        n += 1
        candidate = f"{prefix}{n}"
    return candidate


def _with_tail(
    source: Path, path: Path, prefix: str, name: str, tail: Callable[[str], Tail]
) -> Path:
    """Write to ``path`` the model ``source`` whose ``probabilities`` are renamed
    ``{p}_base``, followed by ``tail(p)`` (whose last node writes ``probabilities`` from
    ``{p}_base``); ``p`` is ``prefix`` made unique in the graph. Returns ``path``.

    Raises ValueError when ``source`` has not digits' signature.
    """
    model = onnx.load(str(source))
    graph = model.graph
    inputs, outputs = [i.name for i in graph.input], [o.name for o in graph.output]
    if inputs != [INPUT_NAME] or outputs != [OUTPUT_NAME]:
        raise ValueError(
            f"{source}: expected one input {INPUT_NAME!r} and one output {OUTPUT_NAME!r}"
        )
    producers = [n for n in graph.node if OUTPUT_NAME in n.output]
    if len(producers) != 1:
        raise ValueError(f"{source}: {len(producers)} nodes write {OUTPUT_NAME!r}")
    p = _fresh_prefix(graph, prefix)
    written = producers[0].output
    written[list(written).index(OUTPUT_NAME)] = f"{p}_base"
    nodes, initializers = tail(p)
    for node in nodes:  # named after what they write, so errors and profiles name them
        out = node.output[0]
        node.name = node.name or (out if out.startswith(f"{p}_") else f"{p}_{out}")
    graph.node.extend(nodes)
    graph.initializer.extend(initializers)
    graph.name = name
    model.producer_name = "mcp_edge.tooling.faulty_models"
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def _input_zero(p: str) -> Tail:
    """Nodes computing the float scalar ``{p}_zero = sum(input * 0)``: zero, but only known
    at run time; the initializer ``{p}_zero_const`` is 0.0."""
    zero = numpy_helper.from_array(np.array(0.0, np.float32), f"{p}_zero_const")
    nodes = [
        helper.make_node("Mul", [INPUT_NAME, zero.name], [f"{p}_times_zero"]),
        helper.make_node("ReduceSum", [f"{p}_times_zero"], [f"{p}_zero"], keepdims=0),
    ]
    return nodes, [zero]


def _fail_unless_zero(p: str, count: str) -> Tail:
    """Nodes that reshape a one-element tensor to ``[1 + count]`` elements (``count``: an int64
    scalar) and add the sum of the result, zero, to ``{p}_base`` as ``probabilities``: the run
    fails unless ``count`` is 0."""
    inits = [
        numpy_helper.from_array(np.zeros(1, np.float32), f"{p}_one_element"),
        numpy_helper.from_array(np.array(1, np.int64), f"{p}_one"),
        numpy_helper.from_array(np.array([0], np.int64), f"{p}_axes"),
    ]
    nodes = [
        helper.make_node("Add", [count, f"{p}_one"], [f"{p}_length"]),
        helper.make_node("Unsqueeze", [f"{p}_length", f"{p}_axes"], [f"{p}_shape"]),
        helper.make_node("Reshape", [f"{p}_one_element", f"{p}_shape"], [f"{p}_reshaped"]),
        helper.make_node("ReduceSum", [f"{p}_reshaped"], [f"{p}_nothing"], keepdims=0),
        helper.make_node("Add", [f"{p}_base", f"{p}_nothing"], [OUTPUT_NAME]),
    ]
    return nodes, inits


def write_warmup_failing_onnx(digits_onnx: Path, path: Path) -> Path:
    """Write a digits model that loads but fails on every run (so on the agent's warm-up).

    Returns:
        ``path``.
    """

    def tail(p: str) -> Tail:
        nodes, inits = _input_zero(p)
        inits.append(numpy_helper.from_array(np.array(1, np.int64), f"{p}_offset"))
        nodes += [
            helper.make_node("Cast", [f"{p}_zero"], [f"{p}_zero_int"], to=TensorProto.INT64),
            helper.make_node("Add", [f"{p}_zero_int", f"{p}_offset"], [f"{p}_count"]),
        ]
        fail, fail_inits = _fail_unless_zero(p, f"{p}_count")
        return nodes + fail, inits + fail_inits

    return _with_tail(digits_onnx, path, "fail", "digits_fails_warmup", tail)


def write_erroring_onnx(digits_onnx: Path, path: Path, *, marker: float = ERROR_MARKER) -> Path:
    """Write a digits model that fails on any batch holding a row whose first pixel equals
    ``marker`` and answers the rest exactly as digits does.

    Returns:
        ``path``.
    """

    def tail(p: str) -> Tail:
        inits = [
            numpy_helper.from_array(np.array(0, np.int64), f"{p}_first_pixel"),
            numpy_helper.from_array(np.array(marker, np.float32), f"{p}_marker"),
        ]
        nodes = [
            helper.make_node("Gather", [INPUT_NAME, f"{p}_first_pixel"], [f"{p}_first"], axis=1),
            helper.make_node("Equal", [f"{p}_first", f"{p}_marker"], [f"{p}_hit"]),
            helper.make_node("Cast", [f"{p}_hit"], [f"{p}_hit_int"], to=TensorProto.INT64),
            helper.make_node("ReduceSum", [f"{p}_hit_int"], [f"{p}_count"], keepdims=0),
        ]
        fail, fail_inits = _fail_unless_zero(p, f"{p}_count")
        return nodes + fail, inits + fail_inits

    return _with_tail(digits_onnx, path, "err", "digits_erroring", tail)


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
    start = rng.standard_normal((size, size)).astype(np.float32)
    weights = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)

    def tail(p: str) -> Tail:
        nodes, inits = _input_zero(p)
        inits += [
            numpy_helper.from_array(start, f"{p}_start"),
            numpy_helper.from_array(weights, f"{p}_weights"),
        ]
        nodes.append(helper.make_node("Add", [f"{p}_start", f"{p}_zero"], [f"{p}_m0"]))
        for i in range(repeats):
            nodes += [
                helper.make_node("MatMul", [f"{p}_m{i}", f"{p}_weights"], [f"{p}_p{i}"]),
                helper.make_node("Tanh", [f"{p}_p{i}"], [f"{p}_m{i + 1}"]),
            ]
        nodes += [
            helper.make_node("ReduceSum", [f"{p}_m{repeats}"], [f"{p}_sum"], keepdims=0),
            helper.make_node("Mul", [f"{p}_sum", f"{p}_zero_const"], [f"{p}_nothing"]),
            helper.make_node("Add", [f"{p}_base", f"{p}_nothing"], [OUTPUT_NAME]),
        ]
        return nodes, inits

    return _with_tail(digits_onnx, path, "slow", "digits_slow", tail)
