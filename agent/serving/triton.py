"""Triton's model configuration extension, built from what the agent loaded.

:func:`model_config` describes one loaded version in the JSON form of Triton's ``ModelConfig``
(``GET /v2/models/{m}[/versions/{v}]/config``; the gRPC ``ModelConfig`` call parses the same
dictionary into its message): inputs and outputs from the model's signature (without the batch
dimension when requests are batched, as Triton writes them), ``max_batch_size`` and
``dynamic_batching`` from the batcher's settings, ``instance_group`` from the instances per
process times the serving processes, and the backend and provider that run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mcp_edge.agent.runtime.batcher import BatchingConfig
from mcp_edge.agent.runtime.manager import LoadedVersion, ModelSlot
from mcp_edge.agent.runtime.runner import TensorSpec

PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "openvino": "openvino_onnx",
             "tflite": "tensorflow_lite"}  # fmt: skip
"""The Open Inference Protocol ``platform`` of each backend (Triton's names where it has one)."""

_GPU_PROVIDERS = frozenset(
    {"CUDAExecutionProvider", "TensorrtExecutionProvider", "ROCMExecutionProvider", "GPU"}
)


_TYPES = {"BYTES": "TYPE_STRING"}


def _tensor(spec: TensorSpec, batched: bool) -> dict[str, Any]:
    dims = list(spec.shape[1:] if batched else spec.shape)
    return {
        "name": spec.name,
        "data_type": _TYPES.get(spec.datatype.value, f"TYPE_{spec.datatype.value}"),
        "dims": dims,
    }


def model_config(
    lv: LoadedVersion,
    slot: ModelSlot,
    batching: BatchingConfig,
    *,
    processes: int = 1,
) -> dict[str, Any]:
    """Triton's ``ModelConfig`` (JSON form) of ``lv``."""
    info = lv.info
    batched = info.batchable and batching.max_batch_size > 1
    outputs: list[dict[str, Any]] = [_tensor(s, batched) for s in info.outputs]
    if lv.source.labels and outputs:
        outputs[0]["label_filename"] = "labels.txt"
    config: dict[str, Any] = {
        "name": lv.name,
        "platform": PLATFORMS.get(info.backend, info.backend),
        "backend": info.backend,
        "version_policy": {"latest": {"num_versions": len(slot.versions)}},
        "max_batch_size": batching.max_batch_size if batched else 0,
        "input": [_tensor(s, batched) for s in info.inputs],
        "output": outputs,
        "instance_group": [
            {
                "name": f"{lv.name}_0",
                "kind": "KIND_GPU" if info.provider in _GPU_PROVIDERS else "KIND_CPU",
                "count": len(lv.runners) * processes,
            }
        ],
        "parameters": {
            "version": {"string_value": lv.version},
            "role": {"string_value": slot.role_of(lv.version)},
            "provider": {"string_value": info.provider},
        },
    }
    if batched:
        config["dynamic_batching"] = {
            "max_queue_delay_microseconds": int(batching.max_queue_delay_s * 1e6),
            "priority_levels": 3,
            "default_priority_level": 2,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": int(batching.default_timeout_s * 1e6),
                "max_queue_size": batching.max_queue,
            },
        }
    if lv.source.variant is not None:
        config["parameters"]["variant"] = {"string_value": lv.source.variant}
    return config


def index_entry(name: str, version: str, state: str, reason: str = "") -> dict[str, Any]:
    """One entry of the repository index (``POST /v2/repository/index``)."""
    return {"name": name, "version": version, "state": state, "reason": reason}


EXTENSIONS: Sequence[str] = ("binary_tensor_data", "classification", "model_configuration",
                             "statistics", "model_repository", "parameters")  # fmt: skip
"""The protocol extensions this server offers (server metadata ``extensions``); loading and
unloading through ``model_repository`` answers only with explicit model control on."""
