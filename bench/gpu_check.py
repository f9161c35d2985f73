"""Accelerator check: the agent's onnxruntime path on CUDA, TensorRT (FP32, FP16), OpenVINO and
CoreML against the CPU, on the machine it runs on.

For two models built here with no downloads (the digits MLP, ``input`` [N, 64], and the digits
convnet, ``input`` [N, 1, 28, 28]), each execution provider is opened the way the agent opens
it: :class:`~mcp_edge.agent.runtime.onnx_runner.OnnxRunner` with the provider list the Jetson
profile gives (TensorRT, then CUDA, then the CPU), the shipped profiles' options for each
provider, built by :func:`~mcp_edge.agent.runtime.providers.provider_options`, and engine
caches in a temporary cache directory. For each it reports:

* ``provider``: what the session runs on (``ok`` is false when it fell back);
* ``load_s``, ``first_b1_ms``, ``first_b32_ms``: opening the session and the first runs (a
  TensorRT engine is built on the first run of a new shape range); TensorRT is then opened again
  over the same cache, ``cached`` gives the same three figures (an engine cache hit);
* ``p50_us`` (batch 1), ``p50_b32_us``, ``rps_b1`` (inferences/s), ``rps_b32`` (items/s at
  batch 32), ``speedup_vs_cpu`` (``rps_b32`` over the CPU's) and ``speedup_vs_cpu_b1``;
* ``max_abs_diff`` and ``argmax_agree`` against the CPU provider's output on the same rows;
  ``ok`` requires the difference within ``tolerance`` and the same class on every row whose
  CPU top-2 margin exceeds the tolerance.

A provider this onnxruntime build lacks is a ``skipped`` entry; one that is present but cannot
open a session (no GPU, missing CUDA libraries) is a ``failed`` entry with onnxruntime's reason.
Exit status: 0; 1 when a provider that ran disagrees with the CPU, or with ``--require-gpu``
when CUDA or TensorRT did not run.

    .venv/bin/python bench/gpu_check.py [--require-gpu] [--out FILE] [--measure-s 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _p in (str(BENCH_DIR), str(REPO_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
import onnxruntime as ort  # noqa: E402

from mcp_edge.agent.runtime.loader import auto_threads  # noqa: E402
from mcp_edge.agent.runtime.onnx_runner import OnnxRunner  # noqa: E402
from mcp_edge.agent.runtime.providers import describe, provider_options  # noqa: E402
from mcp_edge.agent.runtime.runner import ModelLoadError  # noqa: E402
from mcp_edge.shared.profiles import load_profiles  # noqa: E402

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TRT = "TensorrtExecutionProvider"
OVEP = "OpenVINOExecutionProvider"
COREML = "CoreMLExecutionProvider"
GPU_PROVIDERS = (CUDA, TRT)
BATCH = 32
CHECK_ROWS = 256
"""Rows compared with the CPU's output (in batches of ``BATCH``)."""

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    rows: FloatArray
    """Real inputs, at least ``BATCH`` rows."""
    description: str


@dataclass(frozen=True)
class Variant:
    """One way of opening a model: a label, the provider list and the comparison tolerance."""

    label: str
    provider: str
    chain: tuple[tuple[str, dict[str, Any]], ...]
    """Profile options per provider, best first (built with ``provider_options`` at open)."""
    tolerance: float
    reopen: bool = False
    """Open a second time over the same cache and report its figures (``cached``)."""


def build_models(directory: Path) -> list[Model]:
    """The digits MLP and the digits convnet, written into ``directory``."""
    from mcp_edge.tooling.models import train_digits_mlp, write_digits_onnx

    mlp = train_digits_mlp(seed=0)
    models = [
        Model(
            "digits",
            write_digits_onnx(mlp.model, directory / "digits.onnx"),
            np.ascontiguousarray(mlp.X_test, dtype=np.float32),
            "sklearn MLPClassifier 64-32-10 via skl2onnx",
        )
    ]
    try:
        from mcp_edge.tooling.models import train_digits_convnet, write_convnet_onnx
    except ImportError:
        from _models import make_convnet

        bench = make_convnet(directory, seed=0)
        rng = np.random.default_rng(1)
        rows = np.round(rng.random((CHECK_ROWS, 1, 28, 28)), 4).astype(np.float32)
        models.append(Model("convnet", bench.path, rows, bench.description + " (random)"))
    else:
        net = train_digits_convnet(seed=0)
        path = write_convnet_onnx(net, directory / "convnet.onnx")
        c1, c2 = net.conv1_weight.shape[0], net.conv2_weight.shape[0]
        models.append(
            Model(
                "convnet",
                path,
                np.ascontiguousarray(net.X_test, dtype=np.float32),
                f"digits convnet conv3x3x{c1}-maxpool-conv3x3x{c2}-gap-gemm10-softmax",
            )
        )
    return models


def _profile_options(profile: str, provider: str) -> dict[str, Any]:
    """The options a shipped profile gives ``provider`` (the check runs what devices run)."""
    entries = load_profiles()[profile].runtime.backends
    found = [dict(e.options) for e in entries if e.provider == provider]
    if not found:
        raise SystemExit(f"profile {profile!r} has no {provider} entry")
    return found[0]


def variants() -> list[Variant]:
    """CPU first (the reference), then every accelerator with its shipped profile's options:
    TensorRT and CUDA from ``jetson-orin`` (TensorRT once as shipped, FP16, and once with FP16
    off), the OpenVINO EP from ``intel-xeon``, CoreML from ``apple-silicon``."""
    trt = _profile_options("jetson-orin", TRT)
    cuda = (CUDA, _profile_options("jetson-orin", CUDA))
    return [
        Variant("CPUExecutionProvider", CPU, ((CPU, {}),), 0.0),
        Variant("CUDAExecutionProvider", CUDA, (cuda, (CPU, {})), 5e-3),
        Variant(
            "TensorrtExecutionProvider:fp32",
            TRT,
            ((TRT, {**trt, "trt_fp16_enable": False}), cuda, (CPU, {})),
            5e-3,
            reopen=True,
        ),
        Variant(
            "TensorrtExecutionProvider:fp16",
            TRT,
            ((TRT, {**trt, "trt_fp16_enable": True}), cuda, (CPU, {})),
            5e-2,
            reopen=True,
        ),
        Variant(
            "OpenVINOExecutionProvider",
            OVEP,
            ((OVEP, _profile_options("intel-xeon", OVEP)), (CPU, {})),
            1e-4,
            reopen=True,
        ),
        Variant(
            "CoreMLExecutionProvider",
            COREML,
            ((COREML, _profile_options("apple-silicon", COREML)), (CPU, {})),
            5e-2,
            reopen=True,
        ),
    ]


def open_runner(model: Model, variant: Variant, cache_dir: Path, threads: int) -> OnnxRunner:
    providers = [
        (name, provider_options(name, options, cache_dir=cache_dir, model_path=model.path))
        for name, options in variant.chain
    ]
    return OnnxRunner(model.path, providers=providers, intra_op_threads=threads)


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def latencies(fn: Callable[[], object], measure_s: float, max_calls: int = 2000) -> list[float]:
    """Per-call seconds of ``fn``, after three warm-up calls, for about ``measure_s``."""
    for _ in range(3):
        fn()
    found: list[float] = []
    deadline = time.perf_counter() + measure_s
    while len(found) < max_calls and (len(found) < 5 or time.perf_counter() < deadline):
        found.append(timed(fn))
    return found


def open_and_first_runs(
    model: Model, variant: Variant, cache_dir: Path, threads: int
) -> tuple[OnnxRunner, dict[str, float]]:
    b1 = {"input": model.rows[:1]}
    b32 = {"input": model.rows[:BATCH]}
    start = time.perf_counter()
    runner = open_runner(model, variant, cache_dir, threads)
    figures = {"load_s": round(time.perf_counter() - start, 3)}
    figures["first_b1_ms"] = round(timed(lambda: runner.run(b1)) * 1e3, 2)
    figures["first_b32_ms"] = round(timed(lambda: runner.run(b32)) * 1e3, 2)
    return runner, figures


def outputs(runner: OnnxRunner, rows: FloatArray) -> FloatArray:
    chunks = [runner.run({"input": rows[i : i + BATCH]}) for i in range(0, len(rows), BATCH)]
    return np.concatenate([c["probabilities"] for c in chunks]).astype(np.float32)


def compare(got: FloatArray, want: FloatArray, tolerance: float) -> dict[str, Any]:
    diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    agree = np.argmax(got, axis=1) == np.argmax(want, axis=1)
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > tolerance
    return {
        "max_abs_diff": diff,
        "argmax_agree": round(float(np.mean(agree)), 4),
        "tolerance": tolerance,
        "ok_outputs": bool(diff <= tolerance and bool(np.all(agree[clear]))),
    }


def check_variant(
    model: Model,
    variant: Variant,
    reference: dict[str, Any] | None,
    cache_root: Path,
    threads: int,
    measure_s: float,
) -> tuple[dict[str, Any], FloatArray | None]:
    available = ort.get_available_providers()
    if variant.provider not in available:
        return {
            "skipped": f"{variant.provider} is not in this onnxruntime build "
            f"({ort.__version__}: {', '.join(available)})"
        }, None
    cache_dir = cache_root / variant.label.replace(":", "-")
    try:
        runner, first = open_and_first_runs(model, variant, cache_dir, threads)
    except (ModelLoadError, ValueError) as e:
        return {"failed": str(e)}, None
    entry: dict[str, Any] = {"provider": runner.info.provider}
    if runner.info.provider != variant.provider:
        entry["failed"] = runner.info.fallback_reason or f"ran on {runner.info.provider}"
        runner.close()
        return entry, None
    entry["options"] = [
        describe(name, provider_options(name, options, cache_dir=cache_dir, model_path=model.path))
        for name, options in variant.chain
    ]
    entry.update(first)
    b1 = {"input": model.rows[:1]}
    b32 = {"input": model.rows[:BATCH]}
    one = latencies(lambda: runner.run(b1), measure_s)
    many = latencies(lambda: runner.run(b32), measure_s)
    entry["p50_us"] = round(statistics.median(one) * 1e6, 1)
    entry["p50_b32_us"] = round(statistics.median(many) * 1e6, 1)
    entry["rps_b1"] = round(len(one) / sum(one), 1)
    entry["rps_b32"] = round(BATCH * len(many) / sum(many), 1)
    rows = model.rows[:CHECK_ROWS]
    got = outputs(runner, rows)
    runner.close()
    if reference is not None:
        entry["speedup_vs_cpu"] = round(entry["rps_b32"] / reference["rps_b32"], 2)
        entry["speedup_vs_cpu_b1"] = round(entry["rps_b1"] / reference["rps_b1"], 2)
        entry.update(compare(got, reference["outputs"], variant.tolerance))
    else:
        entry.update({"max_abs_diff": 0.0, "argmax_agree": 1.0, "ok_outputs": True})
    if variant.reopen:
        try:
            again, cached = open_and_first_runs(model, variant, cache_dir, threads)
        except (ModelLoadError, ValueError) as e:
            entry["cached"] = {"failed": str(e)}
        else:
            again.close()
            cached["files"] = sum(1 for p in cache_dir.rglob("*") if p.is_file())
            entry["cached"] = cached
    entry["ok"] = entry.pop("ok_outputs")
    return entry, got


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "system": platform.system(),
        "cpus": os.cpu_count(),
        "intra_op_threads": auto_threads(),
        "onnxruntime": ort.__version__,
        "onnxruntime_device": ort.get_device(),
        "available_providers": ort.get_available_providers(),
    }
    if shutil.which("nvidia-smi"):
        try:
            query = "--query-gpu=name,driver_version,memory.total"
            found = subprocess.run(
                ["nvidia-smi", query, "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            env["gpus"] = [line.strip() for line in found.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError) as e:
            env["gpus"] = f"nvidia-smi failed: {e}"
    tegra = Path("/etc/nv_tegra_release")
    if tegra.is_file():
        env["l4t"] = tegra.read_text(errors="replace").splitlines()[0][:200]
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--require-gpu",
        action="store_true",
        help="exit 1 unless CUDA and TensorRT both ran and agreed with the CPU",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON document here")
    parser.add_argument(
        "--measure-s", type=float, default=0.5, help="seconds per latency measurement"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    threads = auto_threads()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="mcp-gpu-check-") as tmp:
        root = Path(tmp)
        for model in build_models(root):
            per_model: dict[str, Any] = {"description": model.description}
            reference: dict[str, Any] | None = None
            for variant in variants():
                entry, got = check_variant(
                    model, variant, reference, root / "cache", threads, args.measure_s
                )
                if variant.provider == CPU:
                    if got is None:
                        raise SystemExit(f"{model.name}: the CPU provider did not run: {entry}")
                    reference = {**entry, "outputs": got}
                per_model[variant.label] = entry
                print(
                    f"gpu_check: {model.name} {variant.label}: {_summary(entry)}", file=sys.stderr
                )
            results[model.name] = per_model
    ran = [e for m in results.values() for e in m.values() if isinstance(e, dict) and "ok" in e]
    gpu_ran = {
        label.split(":")[0]
        for m in results.values()
        for label, e in m.items()
        if isinstance(e, dict) and e.get("ok") and label.split(":")[0] in GPU_PROVIDERS
    }
    all_ok = all(e["ok"] for e in ran)
    document = {
        "environment": environment(),
        "results": results,
        "ok": all_ok,
        "gpu_ran": sorted(gpu_ran),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(document, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    if not all_ok:
        return 1
    if args.require_gpu and gpu_ran != set(GPU_PROVIDERS):
        missing = ", ".join(sorted(set(GPU_PROVIDERS) - gpu_ran))
        print(f"gpu_check: --require-gpu: {missing} did not run", file=sys.stderr)
        return 1
    return 0


def _summary(entry: dict[str, Any]) -> str:
    if "skipped" in entry:
        return "skipped"
    if "failed" in entry:
        return "failed: " + str(entry["failed"])[:160]
    return (
        f"p50 {entry['p50_us']} us, b32 {entry['rps_b32']} items/s, "
        f"x{entry.get('speedup_vs_cpu', 1.0)} vs CPU, diff {entry['max_abs_diff']:.2e}, "
        f"ok={entry['ok']}"
    )


if __name__ == "__main__":
    sys.exit(main())
