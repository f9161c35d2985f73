"""Child of bench/backends.py for tflite-runtime, run with the NumPy 1 overlay
(``.cache/numpy1``, which ``tests/run.sh`` installs) first on ``PYTHONPATH``: tflite-runtime 2.14
is built against NumPy 1 and cannot run under the NumPy 2 of ``.venv``. Measures it against
onnxruntime's CPU provider in the same process and rounds, on the model files and inputs the
parent wrote into ``--work``. Prints one JSON document."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from backends import Contender, _accuracy, _agreement, _interleave

from mcp_edge.agent.runtime.loader import auto_threads
from mcp_edge.agent.runtime.onnx_runner import OnnxRunner
from mcp_edge.agent.runtime.tflite_runner import TFLiteRunner


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, slice_s = (3, 0.1) if args.quick else (7, 0.4)
    threads = auto_threads()
    report: dict[str, Any] = {"numpy": np.__version__}
    for name in ("digits", "convnet"):
        X = np.load(args.work / f"{name}.X_test.npy")
        y = np.load(args.work / f"{name}.y_test.npy")
        b1, b32 = {"input": X[:1]}, {"input": X[:32]}
        cpu = OnnxRunner(args.work / f"{name}.onnx", intra_op_threads=threads)
        tfl = TFLiteRunner(args.work / f"{name}.tflite", num_threads=threads, use_xnnpack=True,
                           implementation="tflite-runtime")  # fmt: skip
        contenders = [Contender("cpu-ep", cpu, b1, b32), Contender("tflite-runtime", tfl, b1, b32)]
        _interleave(contenders, rounds, slice_s)
        base, other = (c.figures() for c in contenders)
        other["speedup_b1"] = round(other["rps_b1"] / base["rps_b1"], 3)
        other["speedup_b32"] = round(other["rps_b32"] / base["rps_b32"], 3)
        reference = cpu.run({"input": X})["probabilities"]
        other.update(_agreement(reference, tfl.run({"input": X})["probabilities"]))
        other["accuracy_pct"] = round(_accuracy(tfl, "input", X, y), 2)
        report[name] = {"onnxruntime-cpu": base, "tflite-runtime": other}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
