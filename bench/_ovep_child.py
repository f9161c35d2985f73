"""Child of bench/backends.py, run with .venv-ovep's Python (onnxruntime-openvino): onnxruntime's
OpenVINO execution provider against the CPU provider of the same onnxruntime build, on the model
files and inputs the parent wrote into ``--work``. Prints one JSON document."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import onnxruntime as ort
from backends import Contender, _agreement, _interleave

from mcp_edge.agent.runtime.loader import auto_threads
from mcp_edge.agent.runtime.onnx_runner import OnnxRunner
from mcp_edge.agent.runtime.providers import provider_options


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, slice_s = (3, 0.1) if args.quick else (7, 0.4)
    threads = auto_threads()
    ep = "OpenVINOExecutionProvider"
    report: dict[str, Any] = {
        "onnxruntime": ort.__version__,
        "providers": ort.get_available_providers(),
    }
    for name in ("digits", "convnet"):
        X = np.load(args.work / f"{name}.X_test.npy")
        b1, b32 = {"input": X[:1]}, {"input": X[:32]}
        model = args.work / f"{name}.onnx"
        cpu = OnnxRunner(model, intra_op_threads=threads)
        options = provider_options(ep, {"device_type": "CPU", "num_of_threads": threads})
        ov = OnnxRunner(model, providers=[(ep, options)], intra_op_threads=threads)
        contenders = [Contender("cpu-ep", cpu, b1, b32), Contender("openvino-ep", ov, b1, b32)]
        _interleave(contenders, rounds, slice_s)
        base, other = (c.figures() for c in contenders)
        other["speedup_b1"] = round(other["rps_b1"] / base["rps_b1"], 3)
        other["speedup_b32"] = round(other["rps_b32"] / base["rps_b32"], 3)
        other.update(
            _agreement(
                cpu.run({"input": X})["probabilities"], ov.run({"input": X})["probabilities"]
            )
        )
        report[name] = {"onnxruntime-cpu": base, "onnxruntime-openvino-ep": other}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
