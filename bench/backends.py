"""Backends bench: every inference backend the agent ships, against onnxruntime's CPU provider.

Models (built at run time, no downloads): the digits MLP (``input`` [N, 64]) and the trained
digits convnet (``input`` [N, 1, 28, 28], a compute-bound model), both from
``mcp_edge.tooling.models``, with real held-out digits as inputs.

For each model and backend it measures, through the agent's own runners (what serving uses):

- ``p50_us``: median latency of one batch-1 call;
- ``rps_b1``: rows per second, batch-1 calls back to back;
- ``rps_b32``: rows per second at batch 32;
- ``speedup_b1`` / ``speedup_b32``: those rates against onnxruntime's CPU execution provider
  (the baseline, measured in the same run, in the same interleaved rounds);
- ``max_abs_diff`` and ``top1_agreement`` against the CPU provider's answers.

Backends: ``onnxruntime-cpu`` (baseline, ``CPUExecutionProvider``), ``openvino`` (the OpenVINO
runtime reading the ONNX file), ``tflite-litert`` and ``tflite-runtime`` (the model's TFLite twin
with XNNPACK), and ``onnxruntime-openvino-ep`` when ``.venv-ovep`` exists
(``deploy/setup-venv-ovep.sh``; it runs in that environment, in a child process, against its
own CPU provider baseline). Then:

- ``int8``: the INT8 variant ``mcp-bundle build --quantize int8`` makes (static, calibrated on
  the training images) against FP32 on onnxruntime CPU and on OpenVINO: throughput and held-out
  accuracy;
- ``selection``: what choosing by measurement (``agent.runtime.selection.select``) picks among
  default/int8 × onnxruntime/openvino, against each candidate's own throughput measured here.

Every rate is the median of interleaved rounds (each backend runs for a short slice in every
round), so a machine whose speed drifts affects all backends alike. Threads: the hardware
profile's setting on this box (``auto_threads()``: half the usable CPUs), the same for every
backend, as serving runs them.

    .venv/bin/python bench/backends.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

import numpy as np  # noqa: E402

from mcp_edge.agent.runtime.loader import auto_threads, load_runner  # noqa: E402
from mcp_edge.agent.runtime.onnx_runner import OnnxRunner  # noqa: E402
from mcp_edge.agent.runtime.runner import ModelRunner, RunnerError  # noqa: E402
from mcp_edge.shared.profiles import load_profiles  # noqa: E402

Array = np.ndarray[Any, Any]
GOALS = {
    "openvino_convnet_b32_speedup": 1.3,
    "int8_convnet_b32_speedup": 1.5,
    "int8_max_accuracy_loss_points": 1.0,
    "selection_within_fastest": 0.05,
}


def _rate(run: Callable[[], object], rows: int, slice_s: float) -> tuple[float, list[float]]:
    """Rows per second over ``slice_s`` of back-to-back calls, and each call's seconds."""
    times: list[float] = []
    end = time.perf_counter() + slice_s
    while True:
        t = time.perf_counter()
        run()
        done = time.perf_counter()
        times.append(done - t)
        if done >= end and len(times) >= 3:
            break
    return rows * len(times) / sum(times), times


class Contender:
    """One backend for one model: a runner and the feeds it takes."""

    def __init__(self, name: str, runner: ModelRunner, b1: dict[str, Array], b32: dict[str, Array]):
        self.name, self.runner, self.b1, self.b32 = name, runner, b1, b32
        self.b1_rates: list[float] = []
        self.b32_rates: list[float] = []
        self.b1_times: list[float] = []

    def round(self, slice_s: float) -> None:
        rate, times = _rate(lambda: self.runner.run(self.b1), 1, slice_s)
        self.b1_rates.append(rate)
        self.b1_times.extend(times)
        if self.runner.info.batchable:
            rate, _ = _rate(lambda: self.runner.run(self.b32), 32, slice_s)
            self.b32_rates.append(rate)

    def figures(self) -> dict[str, Any]:
        return {
            "provider": f"{self.runner.info.backend}/{self.runner.info.provider}",
            "p50_us": round(statistics.median(self.b1_times) * 1e6, 2),
            "rps_b1": round(statistics.median(self.b1_rates), 1),
            "rps_b32": round(statistics.median(self.b32_rates), 1) if self.b32_rates else None,
        }


def _interleave(contenders: list[Contender], rounds: int, slice_s: float) -> None:
    for c in contenders:  # warm every backend before any timing
        c.runner.run(c.b1)
        if c.runner.info.batchable:
            c.runner.run(c.b32)
    for i in range(rounds):
        order = contenders if i % 2 == 0 else list(reversed(contenders))
        for c in order:
            c.round(slice_s)


def _agreement(reference: Array, answer: Array) -> dict[str, float]:
    return {
        "max_abs_diff": float(np.max(np.abs(reference.astype(np.float64) - answer))),
        "top1_agreement": float(np.mean(reference.argmax(axis=1) == answer.argmax(axis=1))),
    }


def _accuracy(runner: ModelRunner, name: str, X: Array, y: Array) -> float:
    out = runner.run({name: X})
    probs = next(iter(out.values()))
    return float(np.mean(probs.argmax(axis=1) == y)) * 100.0


def _models(work: Path) -> list[dict[str, Any]]:
    from mcp_edge.tooling import models as tm

    mlp = tm.train_digits_mlp(seed=0)
    digits_onnx = tm.write_digits_onnx(mlp.model, work / "digits.onnx")
    digits_tflite = tm.write_digits_tflite(mlp.model, work / "digits.tflite")
    net = tm.train_digits_convnet(seed=0)
    conv_onnx = tm.write_convnet_onnx(net, work / "convnet.onnx")
    conv_tflite = tm.write_convnet_tflite(net, work / "convnet.tflite")
    return [
        {
            "name": "digits",
            "onnx": digits_onnx,
            "tflite": digits_tflite,
            "X_train": np.ascontiguousarray(mlp.X_train, dtype=np.float32),
            "X_test": np.ascontiguousarray(mlp.X_test, dtype=np.float32),
            "y_test": np.asarray(mlp.y_test),
        },
        {
            "name": "convnet",
            "onnx": conv_onnx,
            "tflite": conv_tflite,
            "X_train": np.ascontiguousarray(net.X_train, dtype=np.float32),
            "X_test": np.ascontiguousarray(net.X_test, dtype=np.float32),
            "y_test": np.asarray(net.y_test),
        },
    ]


def _openvino_f32(path: Path, threads: int) -> ModelRunner:
    from mcp_edge.agent.runtime.openvino_runner import OpenVINORunner

    return OpenVINORunner(path, num_threads=threads, config={"INFERENCE_PRECISION_HINT": "f32"})


def _tflite_runner(path: Path, implementation: str, threads: int) -> ModelRunner:
    from mcp_edge.agent.runtime.tflite_runner import TFLiteRunner

    return TFLiteRunner(path, num_threads=threads, use_xnnpack=True, implementation=implementation)


def bench_model(m: dict[str, Any], rounds: int, slice_s: float, threads: int) -> dict[str, Any]:
    profile = load_profiles()["intel-xeon"]
    X_test: Array = m["X_test"]
    b1 = {"input": np.ascontiguousarray(X_test[:1])}
    b32 = {"input": np.ascontiguousarray(X_test[:32])}
    makers: list[tuple[str, Callable[[], ModelRunner]]] = [
        ("onnxruntime-cpu", lambda: OnnxRunner(m["onnx"], intra_op_threads=threads)),
        ("openvino", lambda: load_runner(m["onnx"], profile, backend="openvino", threads=threads)),
        ("openvino-f32", lambda: _openvino_f32(m["onnx"], threads)),
        ("tflite-litert", lambda: _tflite_runner(m["tflite"], "ai-edge-litert", threads)),
        ("tflite-runtime", lambda: _tflite_runner(m["tflite"], "tflite-runtime", threads)),
    ]
    contenders: list[Contender] = []
    skipped: dict[str, str] = {}
    for name, make in makers:
        try:
            runner = make()
        except (RunnerError, TypeError) as e:
            skipped[name] = str(e)
            continue
        if name.startswith("openvino") and runner.info.backend != "openvino":
            skipped[name] = f"fell back to {runner.info.backend}: {runner.info.fallback_reason}"
            runner.close()
            continue
        contenders.append(Contender(name, runner, b1, b32))
    _interleave(contenders, rounds, slice_s)
    base = contenders[0]
    reference = base.runner.run({"input": X_test})["probabilities"]
    result: dict[str, Any] = {}
    for c in contenders:
        fig = c.figures()
        fig["speedup_b1"] = round(fig["rps_b1"] / base.figures()["rps_b1"], 3)
        if fig["rps_b32"] is not None and base.figures()["rps_b32"]:
            fig["speedup_b32"] = round(fig["rps_b32"] / base.figures()["rps_b32"], 3)
        answer = c.runner.run({"input": X_test})["probabilities"]
        fig.update(_agreement(reference, answer))
        fig["accuracy_pct"] = round(_accuracy(c.runner, "input", X_test, m["y_test"]), 2)
        result[c.name] = fig
        c.runner.close()
    for name, why in skipped.items():
        result[name] = {"skipped": why}
    return result


def bench_int8(
    m: dict[str, Any], work: Path, rounds: int, slice_s: float, threads: int
) -> dict[str, Any]:
    from mcp_edge.shared.bundle.quantize import quantize_int8

    profile = load_profiles()["intel-xeon"]
    int8 = quantize_int8(m["onnx"], work / f"{m['name']}.int8.onnx", mode="static",
                         calibration=m["X_train"][:200], input_name="input")  # fmt: skip
    X_test: Array = m["X_test"]
    b1 = {"input": np.ascontiguousarray(X_test[:1])}
    b32 = {"input": np.ascontiguousarray(X_test[:32])}
    pairs = {
        "fp32/onnxruntime": lambda: OnnxRunner(m["onnx"], intra_op_threads=threads),
        "int8/onnxruntime": lambda: OnnxRunner(int8, intra_op_threads=threads),
        "fp32/openvino": lambda: load_runner(
            m["onnx"], profile, backend="openvino", threads=threads
        ),
        "int8/openvino": lambda: load_runner(int8, profile, backend="openvino", threads=threads),
    }
    contenders = []
    out: dict[str, Any] = {}
    for name, make in pairs.items():
        runner = make()
        if runner.info.backend != name.split("/")[1]:
            out[name] = {"skipped": f"ran on {runner.info.backend}: {runner.info.fallback_reason}"}
            runner.close()
            continue
        contenders.append(Contender(name, runner, b1, b32))
    _interleave(contenders, rounds, slice_s)
    for c in contenders:
        fig = c.figures()
        fig["accuracy_pct"] = round(_accuracy(c.runner, "input", X_test, m["y_test"]), 2)
        out[c.name] = fig
        c.runner.close()
    for backend in ("onnxruntime", "openvino"):
        fp32, q = out[f"fp32/{backend}"], out[f"int8/{backend}"]
        if "skipped" in fp32 or "skipped" in q:
            out[f"int8_vs_fp32_{backend}"] = {"skipped": q.get("skipped") or fp32["skipped"]}
            continue
        out[f"int8_vs_fp32_{backend}"] = {
            "speedup_b1": round(q["rps_b1"] / fp32["rps_b1"], 3),
            "speedup_b32": round(q["rps_b32"] / fp32["rps_b32"], 3) if q["rps_b32"] else None,
            "accuracy_delta_points": round(q["accuracy_pct"] - fp32["accuracy_pct"], 2),
        }
    out["int8_file"] = str(int8)
    return out


def bench_selection(m: dict[str, Any], int8: Path, repeats: int, rounds: int, slice_s: float,
                    threads: int) -> dict[str, Any]:  # fmt: skip
    from mcp_edge.agent.runtime.selection import Candidate, select

    profile = load_profiles()["intel-xeon"]
    candidates = [
        Candidate("default", m["onnx"], "onnxruntime"),
        Candidate("default", m["onnx"], "openvino"),
        Candidate("int8", int8, "onnxruntime", quantized=True),
        Candidate("int8", int8, "openvino", quantized=True),
    ]
    chosen: list[str] = []
    seconds: list[float] = []
    for _ in range(repeats):
        sel = select(candidates, profile, threads=threads)
        chosen.append(f"{sel.chosen.variant}/{sel.chosen.backend}")
        seconds.append(sel.seconds)
    X_test: Array = m["X_test"]
    b1 = {"input": np.ascontiguousarray(X_test[:1])}
    b32 = {"input": np.ascontiguousarray(X_test[:32])}
    contenders = [
        Contender(f"{c.variant}/{c.backend}",
                  load_runner(c.model_path, profile, backend=c.backend, threads=threads), b1, b32)
        for c in candidates
    ]  # fmt: skip
    _interleave(contenders, rounds, slice_s)
    figures = {c.name: c.figures() for c in contenders}
    for c in contenders:
        c.runner.close()
    key = "rps_b32"
    fastest = max(figures, key=lambda n: figures[n][key] or 0.0)
    gaps = [1.0 - figures[name][key] / figures[fastest][key] for name in chosen]
    return {
        "measured": figures,
        "fastest": fastest,
        "chosen": chosen,
        "selection_seconds": [round(s, 2) for s in seconds],
        "worst_gap_vs_fastest": round(max(gaps), 4),
        "median_gap_vs_fastest": round(statistics.median(gaps), 4),
    }


def bench_ovep(models: list[dict[str, Any]], work: Path, quick: bool) -> dict[str, Any]:
    python = REPO_ROOT / os.environ.get("MCP_OVEP_VENV", ".venv-ovep") / "bin" / "python"
    for m in models:
        np.save(work / f"{m['name']}.X_test.npy", m["X_test"])
        np.save(work / f"{m['name']}.y_test.npy", m["y_test"])
    if not python.exists():
        return {"skipped": f"{python} not found (bash deploy/setup-venv-ovep.sh makes it)"}
    args = [str(python), str(BENCH_DIR / "_ovep_child.py"), "--work", str(work)]
    if quick:
        args.append("--quick")
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-5:]}
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def bench_tflite_runtime(work: Path, quick: bool) -> dict[str, Any]:
    """tflite-runtime under the NumPy 1 overlay, in a child process (see its module)."""
    overlay = REPO_ROOT / ".cache" / "numpy1"
    if not (overlay / "numpy").is_dir():
        return {"skipped": f"{overlay} not found (bash tests/run.sh installs it)"}
    args = [sys.executable, str(BENCH_DIR / "_tflite_runtime_child.py"), "--work", str(work)]
    if quick:
        args.append("--quick")
    env = dict(os.environ, PYTHONPATH=str(overlay))
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, check=False, env=env)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-5:]}
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    rounds, slice_s, repeats = (3, 0.1, 1) if args.quick else (7, 0.4, 5)
    threads = auto_threads()
    started = time.time()
    report: dict[str, Any] = {
        "bench": "backends",
        "quick": args.quick,
        "machine": {
            "cpus": os.cpu_count(),
            "threads": threads,
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "versions": _versions(),
        "goals": GOALS,
    }
    with tempfile.TemporaryDirectory(prefix="mcp-bench-backends-") as tmp:
        work = Path(tmp)
        models = _models(work)
        report["models"] = {m["name"]: bench_model(m, rounds, slice_s, threads) for m in models}
        report["int8"] = {m["name"]: bench_int8(m, work, rounds, slice_s, threads) for m in models}
        conv = next(m for m in models if m["name"] == "convnet")
        int8_conv = Path(report["int8"]["convnet"].pop("int8_file"))
        report["int8"]["digits"].pop("int8_file")
        report["selection"] = {
            "convnet": bench_selection(conv, int8_conv, repeats, rounds, slice_s, threads)
        }
        report["onnxruntime_openvino_ep"] = bench_ovep(models, work, args.quick)
        report["tflite_runtime_numpy1"] = bench_tflite_runtime(work, args.quick)
    report["summary"] = _summary(report)
    report["seconds"] = round(time.time() - started, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    conv = report["models"]["convnet"]
    ov = conv.get("openvino", {}).get("speedup_b32")
    i8 = report["int8"]["convnet"]
    best_int8 = max(
        (i8[f"int8_vs_fp32_{b}"] for b in ("onnxruntime", "openvino")),
        key=lambda d: d.get("speedup_b32") or 0.0,
    )
    loss = -min(0.0, i8["int8_vs_fp32_onnxruntime"]["accuracy_delta_points"])
    gap = report["selection"]["convnet"]["worst_gap_vs_fastest"]
    return {
        "openvino_convnet_b32_speedup": {"value": ov, "goal": ">= 1.3",
                                         "pass": ov is not None and ov >= 1.3},
        "int8_convnet_b32_speedup_onnxruntime": {
            "value": i8["int8_vs_fp32_onnxruntime"]["speedup_b32"], "goal": ">= 1.5",
            "pass": (i8["int8_vs_fp32_onnxruntime"]["speedup_b32"] or 0) >= 1.5},
        "int8_convnet_b32_speedup_best_backend": {"value": best_int8.get("speedup_b32")},
        "int8_convnet_accuracy_loss_points": {"value": loss, "goal": "<= 1", "pass": loss <= 1.0},
        "selection_worst_gap_vs_fastest": {"value": gap, "goal": "<= 0.05", "pass": gap <= 0.05},
    }  # fmt: skip


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for dist in ("onnxruntime", "openvino", "ai-edge-litert", "tflite-runtime", "numpy"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found


if __name__ == "__main__":
    sys.exit(main())
