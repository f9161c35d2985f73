"""Health and inference telemetry: tegrastats parsing on recorded lines, psutil health, and the
inference statistics per model version and role (the collector, the model manager feeding it
with a canary and a shadow, and the shadow agreement test)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_edge.agent.fleet.telemetry import (
    LATENCY_EDGES_MS,
    HealthCollector,
    InferenceStatsCollector,
    Outcome,
    TegrastatsParseError,
    TegrastatsReader,
    parse_tegrastats_line,
)
from mcp_edge.agent.runtime.canary import answers_agree
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.runtime.runner import Array, ModelRunner
from mcp_edge.shared.protocol import HealthSample, InferenceStats, decode, encode, encode_report
from mcp_edge.shared.protocol.canary import CanaryPolicy
from mcp_edge.shared.protocol.reports import InferenceRole, ModelInferenceReport
from tests.support.runners import DoublingRunner, FailingAfterWarmup

# Lines as boards print them (from public logs of real devices).
ORIN_AGX = (
    "RAM 13123/62841MB (lfb 63x4MB) SWAP 9/31420MB (cached 0MB) CPU [3%@729,4%@729,1%@729,"
    "4%@729,1%@729,3%@729,2%@729,1%@729,4%@729,2%@729,1%@729,1%@729] GR3D_FREQ 0% "
    "cpu@48.156C soc2@43.562C soc0@45.125C tj@48.156C soc1@44.343C VDD_GPU_SOC 3193mW/3193mW "
    "VDD_CPU_CV 399mW/399mW VIN_SYS_5V0 4306mW/4306mW"
)
ORIN_NANO_JP6 = (
    "10-08-2026 04:35:02 RAM 6712/7620MB (lfb 12x4MB) SWAP 369/3810MB (cached 8MB) "
    "CPU [38%@1497,2%@729,1%@729,0%@729,1%@729,0%@729] EMC_FREQ 61%@2133 "
    "GR3D_FREQ 99%@[612] NVDEC off NVJPG off VIC off OFA off APE 200 "
    "cpu@57.125C soc2@55.093C soc0@56.625C gpu@58.625C tj@58.312C soc1@55.937C "
    "VDD_IN 5251mW/8535mW VDD_CPU_GPU_CV 512mW/1944mW VDD_SOC 2720mW/3659mW"
)
ORIN_NANO_OFF_CORE = (
    "08-23-2026 13:57:46 RAM 3595/7607MB (lfb 1x1MB) SWAP 11/3804MB (cached 0MB) "
    "CPU [1%@729,off,3%@729,4%@729,5%@729,6%@729] EMC_FREQ 2%@2133 GR3D_FREQ 7%@[306] "
    "cpu@51C soc2@50.562C soc0@51.031C gpu@50.5C tj@51C soc1@50C "
    "VDD_IN 5832mW/5852mW VDD_CPU_GPU_CV 1307mW/1327mW VDD_SOC 1468mW/1468mW"
)
XAVIER_AGX = (
    "RAM 10881/31919MB (lfb 4230x4MB) SWAP 0/15959MB (cached 0MB) CPU [17%@1190,17%@1190,"
    "18%@1190,25%@1190,17%@1336,15%@1340,23%@1543,15%@1574] EMC_FREQ 55%@2133 "
    "GR3D_FREQ 95%@1377 APE 150 MTS fg 0% bg 10% AO@48C GPU@54.5C Tdiode@53.25C PMIC@100C "
    "AUX@46C CPU@49C thermal@49.45C Tboard@47C GPU 18401/18525 CPU 2301/2330 SOC 4602/4602 "
    "CV 0/0 VDDRQ 2914/2911 SYS5V 4632/4620"
)
NANO_JP4 = (
    "RAM 1766/3964MB (lfb 197x4MB) SWAP 0/2048MB (cached 0MB) CPU [24%@1224,15%@1224,"
    "13%@1224,10%@1224] EMC_FREQ 0% GR3D_FREQ 0% PLL@21C CPU@25C PMIC@100C GPU@23.5C "
    "AO@33.5C thermal@24.5C POM_5V_IN 2545/2547 POM_5V_GPU 0/0 POM_5V_CPU 549/529"
)
TX1_L4T28 = (
    "RAM 3607/3983MB (lfb 47x4MB) SWAP 873/8192MB (cached 281MB) cpu [17%,11%,65%,0%]@1734 "
    "EMC 1%@1600 APE 25 GR3D 39%@76"
)


def test_orin_agx_jetpack5() -> None:
    r = parse_tegrastats_line(ORIN_AGX)
    assert (r.ram_used_mb, r.ram_total_mb) == (13123, 62841)
    assert (r.swap_used_mb, r.swap_total_mb, r.swap_cached_mb) == (9, 31420, 0)
    assert len(r.cpus) == 12 and r.cpus[0].load_percent == 3 and r.cpus[0].freq_mhz == 729
    assert r.gr3d_percent == 0 and r.emc_percent is None
    assert r.temperatures_c == {
        "cpu": 48.156,
        "soc2": 43.562,
        "soc0": 45.125,
        "tj": 48.156,
        "soc1": 44.343,
    }
    assert r.rails_mw["VIN_SYS_5V0"] == (4306, 4306)
    assert r.gpu_power_mw == 3193 and r.input_power_mw is None
    assert r.gpu.util_percent == 0 and r.gpu.power_mw == 3193


def test_orin_nano_jetpack6_with_timestamp_engines_and_bracketed_gpu_frequency() -> None:
    r = parse_tegrastats_line(ORIN_NANO_JP6)
    assert (r.ram_used_mb, r.swap_cached_mb) == (6712, 8)
    assert [c.freq_mhz for c in r.cpus] == [1497, 729, 729, 729, 729, 729]
    assert (r.emc_percent, r.emc_freq_mhz) == (61, 2133)
    assert (r.gr3d_percent, r.gr3d_freq_mhz) == (99, 612)
    assert r.temperatures_c["gpu"] == 58.625 and r.temperatures_c["tj"] == 58.312
    assert r.rails_mw["VDD_IN"] == (5251, 8535)
    assert r.input_power_mw == 5251 and r.gpu_power_mw == 512  # VDD_CPU_GPU_CV carries the GPU
    assert set(r.rails_mw) == {"VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"}


def test_powered_down_cores_are_none() -> None:
    r = parse_tegrastats_line(ORIN_NANO_OFF_CORE)
    assert r.cpus[1].load_percent is None and r.cpus[1].freq_mhz is None
    assert [c.load_percent for c in r.cpus] == [1, None, 3, 4, 5, 6]
    assert r.gr3d_percent == 7 and r.gr3d_freq_mhz == 306


def test_xavier_rails_without_units_and_upper_case_sensors() -> None:
    r = parse_tegrastats_line(XAVIER_AGX)
    assert r.rails_mw == {
        "GPU": (18401, 18525),
        "CPU": (2301, 2330),
        "SOC": (4602, 4602),
        "CV": (0, 0),
        "VDDRQ": (2914, 2911),
        "SYS5V": (4632, 4620),
    }
    assert r.gpu_power_mw == 18401
    assert r.temperatures_c["gpu"] == 54.5 and r.temperatures_c["tboard"] == 47
    assert "mts" not in r.temperatures_c
    assert (r.emc_percent, r.gr3d_percent, r.gr3d_freq_mhz) == (55, 95, 1377)
    assert len(r.cpus) == 8 and r.cpus[-1].freq_mhz == 1574


def test_nano_jetpack4_pom_rails() -> None:
    r = parse_tegrastats_line(NANO_JP4)
    assert r.input_power_mw == 2545 and r.gpu_power_mw == 0
    assert r.rails_mw["POM_5V_CPU"] == (549, 529)
    assert r.temperatures_c["pll"] == 21 and r.temperatures_c["gpu"] == 23.5
    assert r.emc_percent == 0 and r.emc_freq_mhz is None


def test_tx1_shared_cpu_frequency_and_short_engine_names() -> None:
    r = parse_tegrastats_line(TX1_L4T28)
    assert [c.load_percent for c in r.cpus] == [17, 11, 65, 0]
    assert {c.freq_mhz for c in r.cpus} == {1734}
    assert (r.emc_percent, r.emc_freq_mhz, r.gr3d_percent) == (1, 1600, 39)
    assert r.rails_mw == {} and r.gpu_power_mw is None


def test_not_tegrastats() -> None:
    with pytest.raises(TegrastatsParseError):
        parse_tegrastats_line("tegrastats: command not found")


@given(st.text(max_size=300))
def test_parser_never_crashes_on_noise(line: str) -> None:
    with contextlib.suppress(TegrastatsParseError):
        parse_tegrastats_line(line)


async def test_reader_runs_a_tegrastats_process_and_keeps_the_latest_line(tmp_path: Path) -> None:
    script = tmp_path / "fake_tegrastats.py"
    script.write_text(
        "import sys, time\n"
        f"print({NANO_JP4!r}, flush=True)\nprint('garbage', flush=True)\n"
        f"print({ORIN_NANO_JP6!r}, flush=True)\n"
        "time.sleep(3600)\n"
    )
    reader = TegrastatsReader([sys.executable, str(script)])
    await reader.start()
    try:
        await until(lambda: reader.latest is not None and reader.latest.gr3d_percent == 99)
        assert reader.bad_lines == 1
        health = HealthCollector(sources=["psutil", "tegrastats"], tegrastats=reader)
        sample = health.collect("dev-1")
        assert sample.gpu is not None and sample.gpu.util_percent == 99
        assert sample.gpu.power_mw == 512 and sample.gpu.emc_percent == 61
        assert sample.temperatures_c["tegra/gpu"] == 58.625
    finally:
        await reader.close()


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for ``condition`` (polling the loop), failing after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


def test_health_sample_from_this_machine_is_valid_on_the_wire(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    zone = sysfs / "class" / "thermal" / "thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("cpu-thermal\n")
    (zone / "temp").write_text("51234\n")
    rapl = sysfs / "class" / "powercap"
    for name, uj in (
        ("intel-rapl:0", "2500000"),
        ("intel-rapl:1", "500000"),
        ("intel-rapl:0:0", "999999999"),
    ):
        (rapl / name).mkdir(parents=True)
        (rapl / name / "energy_uj").write_text(uj)
    collector = HealthCollector(
        sources=["psutil", "thermal_zone", "rapl"],
        disk_path=tmp_path,
        sysfs=sysfs,
        clock=lambda: 1234.5,
    )
    sample = collector.collect("dev-1")
    assert sample.ts == 1234.5 and sample.device_id == "dev-1"
    assert 0 < sample.mem_used_mb <= sample.mem_total_mb
    assert sample.disk_total_mb and sample.disk_free_mb is not None
    assert sample.process_rss_mb and sample.process_rss_mb > 10
    assert sample.temperatures_c["zone/cpu-thermal"] == pytest.approx(51.234)
    assert sample.energy_j == pytest.approx(3.0)  # packages only, not their sub-zones
    # The control plane's schema takes it, and reads back exactly what was sent.
    assert encode(decode(encode_report(sample), HealthSample)) == encode_report(sample)


def test_inference_stats_per_version_and_role_with_percentiles_and_histogram() -> None:
    now = [100.0]
    stats = InferenceStatsCollector(clock=lambda: now[0], rng=random.Random(0))
    for i in range(1, 101):
        stats.record("digits", "1.2.0", i / 1000.0, Outcome.OK)  # 1..100 ms
    stats.record("digits", "1.2.0", 0.5, Outcome.ERROR)
    stats.record("digits", "1.3.0", 0.002, Outcome.OK, role=InferenceRole.CANARY)
    stats.record("digits", "1.3.0", 0.0, Outcome.REJECTED, role=InferenceRole.CANARY)
    stats.record("digits", "1.3.0", 0.003, Outcome.OK, role=InferenceRole.SHADOW, agreed=True)
    stats.record("digits", "1.3.0", 0.004, Outcome.OK, role=InferenceRole.SHADOW, agreed=False)
    stats.record("digits", "1.3.0", 0.004, Outcome.ERROR, role=InferenceRole.SHADOW)
    now[0] = 160.0
    snap = stats.snapshot("dev-1", now=5000.0)
    assert snap.window_s == 60.0 and snap.ts == 5000.0
    by_key = {(m.version, m.role): m for m in snap.models}
    assert list(by_key) == [("1.2.0", InferenceRole.STABLE), ("1.3.0", InferenceRole.CANARY),
                            ("1.3.0", InferenceRole.SHADOW)]  # fmt: skip
    old = by_key["1.2.0", InferenceRole.STABLE]
    canary = by_key["1.3.0", InferenceRole.CANARY]
    shadow = by_key["1.3.0", InferenceRole.SHADOW]
    assert (old.count, old.errors, old.rejections) == (101, 1, 0)
    assert (canary.count, canary.errors, canary.rejections) == (2, 0, 1)
    assert (shadow.count, shadow.errors, shadow.shadow_compared, shadow.shadow_agreed) == (
        3,
        1,
        2,
        1,
    )
    assert (old.shadow_compared, canary.shadow_compared) == (0, 0)
    assert old.latency is not None
    assert old.latency.p50_ms == pytest.approx(50.5)
    assert old.latency.p95_ms == pytest.approx(95.05)
    assert old.latency.p99_ms == pytest.approx(99.01)
    # The histogram holds the successful requests: count - errors - rejections.
    assert old.latency_bucket_edges_ms == list(LATENCY_EDGES_MS)
    assert sum(old.latency_bucket_counts) == 100 and sum(canary.latency_bucket_counts) == 1
    assert len(old.latency_bucket_counts) == len(old.latency_bucket_edges_ms) + 1
    # 1..100 ms on the edges: e.g. 26..35 ms fall in the bucket ending at 35 ms.
    assert old.latency_bucket_counts[LATENCY_EDGES_MS.index(35.0)] == 10
    # What the agent sends passes the control plane's schema, role included.
    wire = decode(encode_report(snap), InferenceStats)
    assert encode(wire) == encode_report(snap)
    assert [m.role.value for m in wire.models] == ["stable", "canary", "shadow"]
    # The window restarts, and a window without requests lists nothing.
    assert stats.snapshot("dev-1").models == []


def test_latency_edges_are_fixed_increasing_and_few() -> None:
    edges = LATENCY_EDGES_MS
    assert edges[0] == 0.25 and edges[-1] == 10_000.0 and len(edges) <= 32
    assert list(edges) == sorted(set(edges))
    for bad in ((), (1.0, 1.0), (2.0, 1.0), (-1.0, 1.0), (1.0, float("inf"))):
        with pytest.raises(ValueError):
            InferenceStatsCollector(edges_ms=bad)


def test_reservoir_keeps_memory_bounded() -> None:
    stats = InferenceStatsCollector(max_samples=100, rng=random.Random(1))
    for i in range(10_000):
        stats.record("m", "1", (i % 100) / 1000.0, Outcome.OK)
    snap = stats.snapshot("dev-1")
    m = snap.models[0]
    assert m.version == "1.0.0" and m.count == 10_000
    assert m.latency is not None and 30 < m.latency.p50_ms < 70
    assert sum(m.latency_bucket_counts) == 10_000


# ------------------------------------------------------------------------------ the manager feeds it
class _ReversingRunner(DoublingRunner):
    """Doubles, then reverses each row: another top class for a row with distinct values."""

    def run(self, feeds: dict[str, Array]) -> dict[str, Array]:
        return {"y": super().run(feeds)["y"][:, ::-1].copy()}


def _rows(n: int) -> list[dict[str, Array]]:
    return [{"x": np.array([[i, 0, 1, 2]], np.float32)} for i in range(n)]


def _by_role(
    stats: InferenceStatsCollector,
) -> dict[tuple[str, InferenceRole], ModelInferenceReport]:
    return {(m.version, m.role): m for m in stats.snapshot("dev-1").models}


def _manager(tmp_path: Path, runners: dict[str, Callable[[], ModelRunner]]) -> ModelManager:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"x")
    return ModelManager(lambda source: [runners[source.version]()],
                        stats=InferenceStatsCollector())  # fmt: skip


async def test_a_canary_failure_answered_by_stable_is_a_canary_error_and_a_stable_request(
    tmp_path: Path,
) -> None:
    failing: list[FailingAfterWarmup] = []

    def canary_runner() -> ModelRunner:
        failing.append(FailingAfterWarmup(DoublingRunner()))
        return failing[-1]

    manager = _manager(tmp_path, {"1": DoublingRunner, "2": canary_runner})
    stats = manager.stats
    assert isinstance(stats, InferenceStatsCollector)
    try:
        await manager.load(ModelSource("m", "1", tmp_path / "m.onnx"))
        await manager.load(ModelSource("m", "2", tmp_path / "m.onnx"), role="canary",
                           canary=CanaryPolicy(weight=1.0, max_error_rate=0.5, min_requests=4))  # fmt: skip
        failing[0].armed = True
        answered = []
        for feeds in _rows(10):
            who, _ = await manager.infer(manager.route("m"), feeds, counted=True)
            answered.append(who.version)
        # A probe (not counted) changes no statistics.
        await manager.infer(manager.get("m", "1"), _rows(1)[0], pinned=True)
    finally:
        await manager.close()
    assert answered == ["1"] * 10  # stable answered every request
    got = _by_role(stats)
    canary, stable = got["2.0.0", InferenceRole.CANARY], got["1.0.0", InferenceRole.STABLE]
    # The canary took requests until its error rate took it out of rotation (4 results).
    assert (canary.count, canary.errors) == (4, 4)
    assert (stable.count, stable.errors) == (10, 0)
    assert sum(stable.latency_bucket_counts) == 10 and sum(canary.latency_bucket_counts) == 0


async def test_shadow_runs_count_as_shadow_requests_with_their_agreement(tmp_path: Path) -> None:
    for shadow_runner, agreeing in ((DoublingRunner, 8), (_ReversingRunner, 1)):
        manager = _manager(tmp_path, {"1": DoublingRunner, "2": shadow_runner})
        stats = manager.stats
        assert isinstance(stats, InferenceStatsCollector)
        try:
            await manager.load(ModelSource("m", "1", tmp_path / "m.onnx"))
            await manager.load(ModelSource("m", "2", tmp_path / "m.onnx"), role="shadow")
            for feeds in _rows(8):
                who, out = await manager.infer(manager.route("m"), feeds, counted=True)
                assert who.version == "1" and np.array_equal(out["y"], feeds["x"] * 2)
            await manager.wait_for_shadows()
        finally:
            await manager.close()
        got = _by_role(stats)
        assert set(got) == {("1.0.0", InferenceRole.STABLE), ("2.0.0", InferenceRole.SHADOW)}
        shadow = got["2.0.0", InferenceRole.SHADOW]
        assert got["1.0.0", InferenceRole.STABLE].count == 8
        assert (shadow.count, shadow.errors, shadow.shadow_compared) == (8, 0, 8)
        # Reversed, the rows [2i, 0, 2, 4] change their top class, except [4, 0, 2, 4] (i = 2:
        # a tie, where the first of the top values wins both ways).
        assert shadow.shadow_agreed == agreeing


# ------------------------------------------------------------------------------ shadow agreement
def _f(*rows: Any) -> Array:
    return np.array(rows, np.float32)


@pytest.mark.parametrize(
    ("stable", "shadow", "agree"),
    [
        ({"y": _f([0.1, 0.9], [0.8, 0.2])}, {"y": _f([0.3, 0.7], [0.6, 0.4])}, True),
        ({"y": _f([0.1, 0.9], [0.8, 0.2])}, {"y": _f([0.3, 0.7], [0.4, 0.6])}, False),
        ({"y": _f([1.0], [2.0])}, {"y": _f([1.0005], [2.0])}, True),  # no argmax: allclose
        ({"y": _f([1.0], [2.0])}, {"y": _f([1.01], [2.0])}, False),
        ({"y": _f(0.5, 0.25)}, {"y": _f(0.5, 0.25)}, True),
        ({"y": _f([float("nan")])}, {"y": _f([float("nan")])}, False),
        ({"y": np.array([3, 1])}, {"y": np.array([3, 1])}, True),  # labels as integers
        ({"y": np.array([1000])}, {"y": np.array([1001])}, False),  # equal, not close
        ({"y": np.array(["cat", "dog"], object)}, {"y": np.array(["cat", "dog"], object)}, True),
        ({"y": np.array(["cat", "dog"], object)}, {"y": np.array(["cat", "cow"], object)}, False),
        ({"y": _f([0.1, 0.9])}, {"y": _f([0.1, 0.9], [0.1, 0.9])}, False),  # shapes differ
        ({"y": _f([0.1, 0.9])}, {"z": _f([0.1, 0.9])}, False),  # nothing to compare
        ({"y": _f([0.1, 0.9]), "n": np.array([1])},
         {"y": _f([0.2, 0.8]), "n": np.array([2])}, False),  # every shared output must agree
    ],
)  # fmt: skip
def test_shadow_answers_agree_by_top_class_closeness_or_equality(
    stable: dict[str, Array], shadow: dict[str, Array], agree: bool
) -> None:
    assert answers_agree(stable, shadow) is agree
