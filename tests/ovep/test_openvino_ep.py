"""onnxruntime's OpenVINO execution provider, for real: runs in the environment
deploy/setup-venv-ovep.sh makes, where ``onnxruntime`` is the onnxruntime-openvino build.

    bash deploy/setup-venv-ovep.sh && .venv-ovep/bin/python -m pytest -q tests/ovep

Elsewhere (the main .venv has the plain onnxruntime) every test here is skipped, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
import pytest

from mcp_edge.agent.runtime.loader import load_runner
from mcp_edge.agent.runtime.onnx_runner import CPU_PROVIDER, OnnxRunner
from mcp_edge.agent.runtime.providers import provider_options
from mcp_edge.shared.profiles import load_profiles

OVEP = "OpenVINOExecutionProvider"

pytestmark = pytest.mark.skipif(
    OVEP not in ort.get_available_providers(),
    reason=f"onnxruntime {ort.__version__} here has no {OVEP} (providers: "
    f"{', '.join(ort.get_available_providers())}); run in .venv-ovep "
    "(bash deploy/setup-venv-ovep.sh)",
)

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Digits:
    onnx_path: Path
    X_test: FloatArray
    y_test: npt.NDArray[np.int64]
    accuracy: float


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Digits:
    """The digits MLP as ONNX (the shared fixture also writes a TFLite twin, and this
    environment has no TFLite interpreter)."""
    from mcp_edge.tooling.models import train_digits_mlp, write_digits_onnx

    mlp = train_digits_mlp(seed=0)
    path = write_digits_onnx(mlp.model, tmp_path_factory.mktemp("digits") / "digits.onnx")
    return Digits(path, mlp.X_test, mlp.y_test, mlp.accuracy)


def _ovep_runner(path: Path, cache: Path, options: dict[str, object] | None = None) -> OnnxRunner:
    built = provider_options(OVEP, options or {"device_type": "CPU"}, cache_dir=cache)
    return OnnxRunner(path, providers=[(OVEP, built), (CPU_PROVIDER, {})], intra_op_threads=1)


def _predict(runner: OnnxRunner, rows: FloatArray, batch: int) -> FloatArray:
    parts = [runner.run({"input": rows[i : i + batch]}) for i in range(0, len(rows), batch)]
    return np.concatenate([p["probabilities"] for p in parts])


@pytest.fixture(scope="module")
def convnet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FloatArray, float]:
    """A small digits convnet (path, held-out images, its accuracy)."""
    from mcp_edge.tooling.models import train_digits_convnet, write_convnet_onnx

    net = train_digits_convnet(seed=0, channels=(16, 64))
    path = write_convnet_onnx(net, tmp_path_factory.mktemp("convnet") / "convnet.onnx")
    return path, net.X_test, net.accuracy


def test_the_digits_mlp_answers_like_the_cpu_provider(digits: Digits, tmp_path: Path) -> None:
    cpu = OnnxRunner(digits.onnx_path, intra_op_threads=1)
    ov = _ovep_runner(digits.onnx_path, tmp_path / "cache")
    assert ov.info.provider == OVEP and ov.info.fallback_reason is None
    assert ov.info.details["providers_in_session"][0] == OVEP
    rows = digits.X_test
    want = _predict(cpu, rows, 32)
    for batch in (1, 7, 32):  # the batch dimension is dynamic
        got = _predict(ov, rows, batch)
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert np.array_equal(np.argmax(got, axis=1), np.argmax(want, axis=1))
    accuracy = float(np.mean(np.argmax(want, axis=1) == digits.y_test))
    assert accuracy == pytest.approx(digits.accuracy)


def test_the_convnet_answers_like_the_cpu_provider(
    convnet: tuple[Path, FloatArray, float], tmp_path: Path
) -> None:
    path, images, accuracy = convnet
    cpu = OnnxRunner(path, intra_op_threads=1)
    ov = _ovep_runner(path, tmp_path / "cache")
    assert ov.info.provider == OVEP and ov.info.fallback_reason is None
    rows = images[:128]
    want = _predict(cpu, rows, 32)
    got = _predict(ov, rows, 32)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.array_equal(np.argmax(got, axis=1), np.argmax(want, axis=1))
    single = _predict(ov, rows[:5], 1)
    np.testing.assert_allclose(single, want[:5], atol=1e-4)
    assert accuracy > 0.8  # a trained model, not noise: agreement means something


def test_compiled_blobs_land_in_the_agents_cache_dir(digits: Digits, tmp_path: Path) -> None:
    cache = tmp_path / "state" / "cache"
    runner = _ovep_runner(digits.onnx_path, cache)
    assert runner.info.provider == OVEP
    runner.run({"input": digits.X_test[:4]})
    blobs = [p for p in (cache / "openvino").rglob("*") if p.is_file()]
    assert blobs, "OpenVINO wrote no compiled model under cache/openvino"
    again = _ovep_runner(digits.onnx_path, cache)
    np.testing.assert_allclose(
        again.run({"input": digits.X_test[:4]})["probabilities"],
        runner.run({"input": digits.X_test[:4]})["probabilities"],
        atol=1e-6,
    )


def test_booleans_are_spelled_the_way_openvino_accepts(digits: Digits, tmp_path: Path) -> None:
    options = {"enable_qdq_optimizer": False, "disable_dynamic_shapes": False}
    runner = _ovep_runner(digits.onnx_path, tmp_path / "cache", {"device_type": "CPU", **options})
    assert runner.info.provider == OVEP and runner.info.fallback_reason is None
    # The spelling the other providers take is refused by OpenVINO: the session falls back.
    raw = OnnxRunner(
        digits.onnx_path, providers=[(OVEP, {"enable_qdq_optimizer": "0"}), (CPU_PROVIDER, {})]
    )
    assert raw.info.provider == CPU_PROVIDER
    assert raw.info.fallback_reason is not None and OVEP in raw.info.fallback_reason


def test_the_xeon_profile_opens_the_openvino_ep_when_asked(digits: Digits, tmp_path: Path) -> None:
    profile = load_profiles()["intel-xeon"]
    cache = tmp_path / "cache"
    runner = load_runner(
        digits.onnx_path, profile, backend="openvino-ep", threads=1, cache_dir=cache
    )
    assert runner.info.provider == OVEP and runner.info.fallback_reason is None
    out = runner.run({"input": digits.X_test[:3]})["probabilities"]
    assert out.shape == (3, 10)
    # The loader built the options through provider_options: the compiled model is cached.
    assert any(p.is_file() for p in (cache / "openvino").rglob("*"))
