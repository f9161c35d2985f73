"""A bundle's variants as TUF targets of their own: the real control plane publishes a signed
bundle (REST, SQLite/PostgreSQL, its TUF repository), its repository service answers devices
over a real Mosquitto, and in-process update agents (the real FleetSession, MQTT transport,
onnxruntime model manager) deploy it under the intel-xeon and generic-x86_64 profiles.

What a user notices: the xeon device downloads the manifest, its signature, its own variant and
the labels, not the whole bundle (counted by the repository's ``mcp_cp_repo_bytes_total``), and
installs and serves that variant; the generic device gets the default; a tampered variant file,
a variant for a backend the device lacks and a variant whose outputs are NaN each end as the
user would want (old version serving, variant skipped, fallback to the default), with the cause
in the deployment's events.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import tarfile
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
from mcp_edge.agent.fleet.spool import Spool
from mcp_edge.agent.runtime.manager import ModelManager
from mcp_edge.agent.serving.serve import runner_factory
from mcp_edge.agent.update.machine import Cause, Phase
from mcp_edge.agent.update.transport_http import HttpRepoTransport
from mcp_edge.agent.update.transport_mqtt import MqttRepoTransport, MqttTransportConfig
from mcp_edge.agent.update.updater import UpdateAgent
from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db.errors import UnavailableError
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.mqtt import BrokerAddress
from mcp_edge.controlplane.repository.mqtt_service import RepoConnection, RepoMqttService
from mcp_edge.controlplane.repository.service import RepositoryService
from mcp_edge.controlplane.settings import PasswordCost, Settings
from mcp_edge.shared.bundle import VariantSource, build_bundle, sign_bundle
from mcp_edge.shared.bundle.build import encode_manifest, write_tar
from mcp_edge.shared.bundle.manifest import BundleManifest
from mcp_edge.shared.mqtt import MqttClient
from mcp_edge.shared.profiles import HardwareProfile, load_profiles
from mcp_edge.shared.protocol.state import (
    DeploymentEvent,
    DesiredModel,
    DesiredState,
    EventOutcome,
    ReportedState,
    TargetRef,
    sign_desired_state,
)
from mcp_edge.shared.signing import PrivateKey, read_private_key
from mcp_edge.tooling.models import DigitsModels, onnx_predict
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker, MosquittoBroker
from mcp_edge.tooling.processes import (
    AGENT,
    BUNDLE,
    CONTROLPLANE,
    REPO,
    free_port,
    init_control_plane,
    serve_control_plane,
    stopped_at_exit,
    wait_until,
)
from tests.support.controlplane import ControlPlane, FakeClock, start_control_plane

CP = CONTROLPLANE
LABELS = "\n".join(f"digit-{i}" for i in range(10)) + "\n"


# ---------------------------------------------------------------------- model files


def padded(digits_onnx: Path, out: Path, pad: int) -> Path:
    """The digits model with ``pad`` bytes of graph doc string: the same answers, a file big
    enough that what a device fetches is not dwarfed by TUF metadata."""
    model = onnx.load(str(digits_onnx))
    model.graph.doc_string = "p" * pad
    onnx.save(model, str(out))
    return out


def nan_model(digits_onnx: Path, out: Path) -> Path:
    """The digits model with every float weight NaN: it loads, and answers NaN."""
    model = onnx.load(str(digits_onnx))
    for init in model.graph.initializer:
        arr = numpy_helper.to_array(init)
        if arr.dtype.kind == "f":
            init.CopyFrom(numpy_helper.from_array(np.full_like(arr, np.nan), init.name))
    onnx.save(model, str(out))
    return out


@dataclass(frozen=True)
class Files:
    default: Path
    xeon: Path
    nan: Path
    labels: Path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, digits: DigitsModels) -> Files:
    out = tmp_path_factory.mktemp("variant-files")
    labels = out / "labels.txt"
    labels.write_text(LABELS)
    return Files(
        default=padded(digits.onnx_path, out / "default.onnx", 120_000),
        xeon=padded(digits.onnx_path, out / "xeon.onnx", 60_000),
        nan=nan_model(digits.onnx_path, out / "nan.onnx"),
        labels=labels,
    )


def make_bundle(files: Files, out: Path, version: str, key: PrivateKey, *,
                xeon: Path | None = None, backend: str | None = None) -> Path:  # fmt: skip
    """digits ``version``: the default variant, a ``xeon`` variant for intel-xeon (``xeon``'s
    file, the padded xeon model unless given), the labels; the xeon variant names ``backend``
    when given. Signed with ``key``."""
    path = out / f"digits-{version}-{uuid.uuid4().hex[:6]}.mcpb"
    build_bundle(files.default, path, name="digits", version=version, labels_path=files.labels,
                 variants={"xeon": VariantSource(xeon or files.xeon, ("intel-xeon",))})  # fmt: skip
    if backend is not None:
        _rewrite_with_backend(path, "xeon", backend)
    sign_bundle(path, key, validate_models=False)
    return path


def _rewrite_with_backend(path: Path, tag: str, backend: str) -> None:
    _rewrite_variant(path, tag, backend=backend)


def _rewrite_variant(path: Path, tag: str, **fields: Any) -> None:
    """Set ``fields`` on variant ``tag`` of the unsigned bundle at ``path`` (rewritten)."""
    with tarfile.open(path) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    doc = json.loads(members.pop("manifest.json"))
    for v in doc["variants"]:
        if v["tag"] == tag:
            v.update(fields)
    manifest = BundleManifest.model_validate_json(json.dumps(doc))
    path.unlink()
    write_tar(path, [("manifest.json", encode_manifest(manifest)),
                     *sorted(members.items())], False)  # fmt: skip


# ---------------------------------------------------------------------- the fleet


class Sink:
    """Collects what an agent publishes (implements agent.update.updater.UpdateSink)."""

    def __init__(self) -> None:
        self.events: list[DeploymentEvent] = []
        self.reported: list[ReportedState] = []

    async def publish_event(self, event: DeploymentEvent) -> None:
        self.events.append(event)

    async def publish_reported(self, state: ReportedState) -> None:
        self.reported.append(state)

    def messages(self, version: str) -> list[str]:
        return [e.message for e in self.events if e.version == version]


@dataclass
class Device:
    device_id: str
    agent: UpdateAgent
    manager: ModelManager
    sink: Sink
    transport: Any
    """The agent's way to the repository (MQTT through the broker, or HTTP)."""
    profile: HardwareProfile


class Crash(BaseException):
    """Raised by a phase hook: the agent stops there as if the process died (its record is
    on disk, nothing after it ran)."""


def crash_at(phase: Phase, when: Any = None) -> Any:
    def hook(at: Phase, record: Any) -> None:
        if at is phase and (when is None or when(record)):
            raise Crash(f"crashed at {phase.value}")

    return hook


@dataclass
class Fleet:
    cp: ControlPlane
    metrics: ControlPlaneMetrics
    publisher: PrivateKey
    director: PrivateKey
    broker: MosquittoBroker
    tmp: Path
    stack: contextlib.AsyncExitStack
    seq: int = 0

    @property
    def repo_dir(self) -> Path:
        return self.cp.settings.data_dir / "repository"

    def bytes_sent(self) -> float:
        value = self.metrics.registry.get_sample_value("mcp_cp_repo_bytes_total")
        return float(value or 0.0)

    async def publish(self, bundle: Path) -> TargetRef:
        status, row = await self.cp.call(
            "POST", "/api/v1/bundles", raw=bundle.read_bytes(),
            headers={"Content-Type": "application/octet-stream"},
        )  # fmt: skip
        assert status == 201, row
        return TargetRef(version=row["version"], target_path=row["target_path"],
                         sha256=row["sha256"], length=row["length"])  # fmt: skip

    async def device(
        self, device_id: str, profile: HardwareProfile, *, phase_hook: Any = None
    ) -> Device:
        suffix = uuid.uuid4().hex[:8]
        config = FleetConfig(device_id=device_id, client_id=f"{device_id}-{suffix}",
                             host=self.broker.host, port=self.broker.port,
                             health_interval_s=3600, inference_interval_s=3600)  # fmt: skip
        mqtt = MqttClient(config.mqtt_settings())
        transport = MqttRepoTransport(mqtt, device_id, MqttTransportConfig(
            chunk_timeout_s=5.0, chunk_retries=3, backoff_initial_s=0.05, backoff_max_s=0.2))  # fmt: skip
        session = FleetSession(config, spool=Spool(self.tmp / f"{device_id}-spool.db"),
                               mqtt=mqtt, repo=transport)  # fmt: skip
        await session.start()
        self.stack.push_async_callback(session.close)
        await session.wait_online(10)
        return await self.start_agent(device_id, profile, transport, phase_hook=phase_hook)

    async def start_agent(
        self, device_id: str, profile: HardwareProfile, transport: Any, *,
        phase_hook: Any = None,
    ) -> Device:  # fmt: skip
        """An update agent on ``device_id``'s state directory (as after a restart), resumed."""
        manager = ModelManager(runner_factory(profile, workers=1, threads=1, backend=None))
        self.stack.push_async_callback(manager.close)
        sink = Sink()
        root = (self.repo_dir / "metadata" / "root.json").read_bytes()
        agent = UpdateAgent(self.tmp / device_id, device_id, profile, manager, transport,
                            [self.director.public_key], events=sink, tuf_root=root,
                            phase_hook=phase_hook)  # fmt: skip
        await agent.resume()
        return Device(device_id, agent, manager, sink, transport, profile)

    async def restart(self, device: Device) -> Device:
        """The agent of ``device`` started again after a crash: resumes what it left."""
        return await self.start_agent(device.device_id, device.profile, device.transport)

    async def deploy(self, device: Device, ref: TargetRef) -> None:
        self.seq += 1
        issued = datetime.now(timezone.utc)
        state = DesiredState(device_id=device.device_id, seq=self.seq, issued_at=issued,
                             expires=issued + timedelta(hours=1),
                             models=[DesiredModel(name="digits", stable=ref)])  # fmt: skip
        await device.agent.handle_desired(sign_desired_state(state, self.director))


@pytest.fixture
async def fleet(
    database_url: str, tmp_path: Path, mosquitto: MosquittoBroker
) -> AsyncIterator[Fleet]:
    settings = Settings(data_dir=tmp_path / "cp", database_url=database_url,
                        password_cost=PasswordCost.MIN)  # fmt: skip
    cp = await start_control_plane(settings, FakeClock(datetime.now(timezone.utc)
                                                       .replace(microsecond=0)))  # fmt: skip
    publisher = PrivateKey.generate()
    status, row = await cp.call("POST", "/api/v1/publishers",
                                body={"name": "vision", "public_key": publisher.public_key.raw.hex()})  # fmt: skip
    assert status == 201, row
    metrics = ControlPlaneMetrics()
    service = RepoMqttService(settings.data_dir / "repository", metrics)
    await service.start(RepoConnection(
        BrokerAddress(mosquitto.host, mosquitto.port),
        Credentials(username="svc-cp", password="unused", client_id=f"cp-repo-{uuid.uuid4().hex[:8]}"),
    ))  # fmt: skip
    director = read_private_key(settings.data_dir / "keys" / "director.key")
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(cp.client.close)
        stack.push_async_callback(service.stop)
        yield Fleet(cp, metrics, publisher, director, mosquitto, tmp_path, stack)


def profile(name: str, *, measure: bool = False) -> HardwareProfile:
    """A shipped profile with choosing by measurement switched as the test needs."""
    base = load_profiles()[name]
    selection = dataclasses.replace(base.runtime.selection, measure=measure)
    return dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, selection=selection))


async def answer(manager: ModelManager, digits: DigitsModels) -> tuple[str, np.ndarray]:
    lv = manager.route("digits")
    who, out = await manager.infer(lv, {"input": digits.X_test[:5]})
    return who.version, out["probabilities"]


def assert_answers_like_fp32(probs: np.ndarray, digits: DigitsModels) -> None:
    """``probs`` (the first five held-out digits) are the FP32 model's answers: the same class,
    each probability within 2e-2 (the Xeon profile runs OpenVINO in bf16 where the CPU lists
    BF16)."""
    want = onnx_predict(digits.onnx_path, digits.X_test[:5])
    np.testing.assert_allclose(probs, want, atol=2e-2)
    assert (probs.argmax(axis=1) == want.argmax(axis=1)).all()


def install_info(device: Device, version: str) -> dict[str, Any]:
    path = device.agent.store.version_dir("digits", version) / "install.json"
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def installed_files(device: Device, version: str) -> set[str]:
    root = device.agent.store.version_dir("digits", version)
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def part_lengths(fleet: Fleet, ref: TargetRef) -> dict[str, int]:
    """Member → length of each part TUF lists for ``ref`` (from the repository's metadata)."""
    from mcp_edge.controlplane.repository.service import repository_for

    targets = repository_for(fleet.cp.settings).targets().signed.targets
    parts = targets[ref.target_path].custom["parts"]
    named = {"manifest.json": parts["manifest"], "manifest.sig": parts["signature"],
             **parts["files"]}  # fmt: skip
    return {member: targets[path].length for member, path in named.items()}


# ---------------------------------------------------------------------- tests


async def test_each_device_fetches_only_its_variant_and_serves_it(
    fleet: Fleet, files: Files, digits: DigitsModels
) -> None:
    ref = await fleet.publish(make_bundle(files, fleet.tmp, "1.0.0", fleet.publisher))
    parts = part_lengths(fleet, ref)
    xeon_file, default_file = "models/model.xeon.onnx", "models/model.onnx"
    assert set(parts) == {"manifest.json", "manifest.sig", default_file, xeon_file,
                          "labels.txt"}  # fmt: skip

    xeon = await fleet.device("dev-xeon-1", profile("intel-xeon"))
    before = fleet.bytes_sent()
    await fleet.deploy(xeon, ref)
    sent = fleet.bytes_sent() - before

    version, probs = await answer(xeon.manager, digits)
    assert version == "1.0.0"
    assert_answers_like_fp32(probs, digits)
    info = install_info(xeon, "1.0.0")
    assert (info["variant"], info["model_file"], info["sha256"]) == ("xeon", xeon_file, ref.sha256)
    assert installed_files(xeon, "1.0.0") == {"manifest.json", "manifest.sig", "install.json",
                                              xeon_file, "labels.txt"}  # fmt: skip
    assert xeon.manager.get("digits").source.labels[:2] == ("digit-0", "digit-1")
    # the repository sent less than the bundle and at least the variant
    fetched = (
        parts["manifest.json"] + parts["manifest.sig"] + parts[xeon_file] + parts["labels.txt"]
    )
    assert parts[xeon_file] <= sent < ref.length, (sent, ref.length)
    downloaded = next(e for e in xeon.sink.events
                      if e.phase is Phase.DOWNLOADING and e.outcome is EventOutcome.OK)  # fmt: skip
    assert downloaded.bytes_done == fetched and downloaded.bytes_total == ref.length
    assert downloaded.message.startswith("downloaded variant xeon: ")
    print(
        f"\nxeon device: repository sent {sent:.0f} bytes (parts {fetched}) for a "
        f"{ref.length}-byte bundle; the xeon model is {parts[xeon_file]} bytes; "
        f"event: {downloaded.message}"
    )

    generic = await fleet.device("dev-generic-1", profile("generic-x86_64"))
    before = fleet.bytes_sent()
    await fleet.deploy(generic, ref)
    sent_generic = fleet.bytes_sent() - before
    assert install_info(generic, "1.0.0")["variant"] == "default"
    assert installed_files(generic, "1.0.0") == {"manifest.json", "manifest.sig", "install.json",
                                                 default_file, "labels.txt"}  # fmt: skip
    assert parts[default_file] <= sent_generic < ref.length
    version, _ = await answer(generic.manager, digits)
    assert version == "1.0.0"
    print(
        f"generic device: repository sent {sent_generic:.0f} bytes; the default model is "
        f"{parts[default_file]} bytes"
    )


async def test_over_http_the_device_fetches_only_its_variant_too(
    fleet: Fleet, files: Files, digits: DigitsModels
) -> None:
    """``mcp-agent run --repo http://cp/repo``: the same parts through the control plane's
    ``/repo/targets/...`` routes (paths with a folder: ``models/...``)."""
    ref = await fleet.publish(make_bundle(files, fleet.tmp, "1.0.0", fleet.publisher))
    base = str(fleet.cp.client.make_url("/repo")).rstrip("/")
    device = await fleet.start_agent("dev-http-1", profile("intel-xeon"), HttpRepoTransport(base))

    await fleet.deploy(device, ref)

    assert install_info(device, "1.0.0")["variant"] == "xeon"
    assert "models/model.onnx" not in installed_files(device, "1.0.0")
    version, _ = await answer(device.manager, digits)
    assert version == "1.0.0"


async def test_measuring_fetches_the_candidates_and_installs_the_chosen_one(
    fleet: Fleet, files: Files, digits: DigitsModels
) -> None:
    ref = await fleet.publish(make_bundle(files, fleet.tmp, "1.0.0", fleet.publisher))
    parts = part_lengths(fleet, ref)
    xeon = await fleet.device("dev-xeon-6", profile("intel-xeon", measure=True))

    await fleet.deploy(xeon, ref)

    info = install_info(xeon, "1.0.0")
    assert info["choice"] is not None and info["backend"] == info["choice"]["chosen"]["backend"]
    assert info["variant"] == info["choice"]["chosen"]["variant"]
    assert info["choice"]["chosen"]["model_path"] == info["model_file"]  # inside the version dir
    tried = {(t["variant"], t["backend"]) for t in info["choice"]["trials"]}
    assert {"xeon", "default"} <= {variant for variant, _ in tried}
    chosen_file = "models/model.xeon.onnx" if info["variant"] == "xeon" else "models/model.onnx"
    assert installed_files(xeon, "1.0.0") == {"manifest.json", "manifest.sig", "install.json",
                                              chosen_file, "labels.txt"}  # fmt: skip
    messages = xeon.sink.messages("1.0.0")
    assert any(m.startswith("downloaded variants xeon, default (to measure)") for m in messages)
    assert any(m.startswith("chose ") for m in messages)
    downloaded = next(e for e in xeon.sink.events
                      if e.phase is Phase.DOWNLOADING and e.outcome is EventOutcome.OK)  # fmt: skip
    both = sum(parts.values())
    assert downloaded.bytes_done == both
    version, _ = await answer(xeon.manager, digits)
    assert version == "1.0.0"


async def test_an_int8_bundle_is_measured_on_a_xeon_and_serves_within_a_point_of_fp32(
    fleet: Fleet, files: Files, digits: DigitsModels
) -> None:
    """The whole path of a quantized variant: `mcp-bundle build --quantize int8` (static,
    calibrated on the training digits), published, measured on a Xeon (every fitting
    variant × backend), installed and served; what serves is within a point of FP32 on
    held-out digits, and the choice with its figures is in install.json and the events."""
    path = fleet.tmp / "digits-int8.mcpb"
    samples = fleet.tmp / "samples.npy"
    np.save(samples, digits.mlp.X_train.astype(np.float32))
    labels = fleet.tmp / "samples-labels.npy"
    np.save(labels, np.asarray(digits.mlp.y_train, dtype=np.int64))
    manifest = build_bundle(digits.onnx_path, path, name="digits", version="1.0.0",
                            labels_path=files.labels, baseline_npy=samples, quantize="int8",
                            calibration_labels=labels)  # fmt: skip
    int8 = manifest.variant("int8")
    assert int8.quantization is not None and int8.quantization.scheme == "int8-static"
    sign_bundle(path, fleet.publisher, validate_models=False)
    ref = await fleet.publish(path)
    xeon = await fleet.device("dev-xeon-int8", profile("intel-xeon", measure=True))

    await fleet.deploy(xeon, ref)

    info = install_info(xeon, "1.0.0")
    choice = info["choice"]
    assert choice is not None and info["variant"] == choice["chosen"]["variant"]
    tried = {t["variant"] for t in choice["trials"]}
    assert tried == {"int8", "default"}
    assert any(m.startswith("chose ") for m in xeon.sink.messages("1.0.0"))
    lv = xeon.manager.route("digits")
    assert lv.source.variant == info["variant"]
    _, out = await xeon.manager.infer(lv, {"input": digits.X_test})
    served = float(np.mean(out["probabilities"].argmax(axis=1) == digits.y_test)) * 100
    fp32 = float(np.mean(onnx_predict(digits.onnx_path, digits.X_test).argmax(axis=1)
                         == digits.y_test)) * 100  # fmt: skip
    assert served >= fp32 - 1.0, (info["variant"], served, fp32)


async def test_a_tampered_variant_file_fails_and_the_old_version_keeps_serving(
    fleet: Fleet, files: Files, digits: DigitsModels
) -> None:
    xeon = await fleet.device("dev-xeon-2", profile("intel-xeon"))
    await fleet.deploy(xeon, await fleet.publish(make_bundle(files, fleet.tmp, "1.0.0",
                                                             fleet.publisher)))  # fmt: skip
    ref = await fleet.publish(make_bundle(files, fleet.tmp, "1.1.0", fleet.publisher))
    stored = next((fleet.repo_dir / "targets" / "digits" / "1.1.0" / "models")
                  .glob("*.model.xeon.onnx"))  # fmt: skip
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))

    await fleet.deploy(xeon, ref)

    version, _ = await answer(xeon.manager, digits)
    assert version == "1.0.0"
    record = xeon.agent.store.record("digits")
    assert record is not None and record.phase is Phase.FAILED
    assert record.cause is Cause.HASH_MISMATCH
    errors = [
        e for e in xeon.sink.events if e.version == "1.1.0" and e.outcome is EventOutcome.ERROR
    ]
    assert errors and errors[0].cause == "hash_mismatch"
    assert "digits/1.1.0/models/model.xeon.onnx" in errors[0].message
    assert xeon.agent.store.installed("digits", "1.1.0") is None
    assert list((fleet.tmp / "dev-xeon-2" / "staging").iterdir()) == []


async def test_a_variant_for_a_backend_the_device_lacks_is_skipped(
    fleet: Fleet, files: Files, digits: DigitsModels
) -> None:
    bundle = make_bundle(files, fleet.tmp, "1.0.0", fleet.publisher, backend="tensorrt")
    ref = await fleet.publish(bundle)
    xeon = await fleet.device("dev-xeon-3", profile("intel-xeon"))

    await fleet.deploy(xeon, ref)

    assert install_info(xeon, "1.0.0")["variant"] == "default"
    skipped = [m for m in xeon.sink.messages("1.0.0") if "skipped" in m]
    assert skipped and "variant xeon skipped: it needs backend tensorrt" in skipped[0]
    assert "models/model.xeon.onnx" not in installed_files(xeon, "1.0.0")
    version, _ = await answer(xeon.manager, digits)
    assert version == "1.0.0"


async def test_a_variant_failing_its_output_checks_falls_back_to_the_default(
    fleet: Fleet, files: Files, digits: DigitsModels
) -> None:
    ref = await fleet.publish(make_bundle(files, fleet.tmp, "1.0.0", fleet.publisher,
                                          xeon=files.nan))  # fmt: skip
    xeon = await fleet.device("dev-xeon-4", profile("intel-xeon"))

    await fleet.deploy(xeon, ref)

    version, probs = await answer(xeon.manager, digits)
    assert version == "1.0.0"
    assert_answers_like_fp32(probs, digits)
    assert install_info(xeon, "1.0.0")["variant"] == "default"
    messages = xeon.sink.messages("1.0.0")
    fallback = [m for m in messages if m.startswith("variant xeon failed")]
    assert fallback and "NaN" in fallback[0] and fallback[0].endswith("trying default")
    downloads = [m for m in messages if m.startswith("downloaded variant")]
    assert [m.split(":")[0] for m in downloads] == ["downloaded variant xeon",
                                                    "downloaded variant default"]  # fmt: skip
    record = xeon.agent.store.record("digits")
    assert record is not None and record.phase is Phase.ACTIVE
    assert set(record.failed_variants) == {"xeon"}


@pytest.mark.parametrize("measure", [False, True], ids=["preferred", "measured"])
async def test_a_quantized_variant_failing_its_output_checks_is_not_served(
    fleet: Fleet, files: Files, digits: DigitsModels, measure: bool
) -> None:
    """An ``int8`` variant (with the quantization figures a build records) whose answers are
    NaN: preferred by the Xeon profile, it fails its output checks and the device falls back
    to the default; measured, its trial fails and the default is chosen. Either way the
    cause is in the events and the default serves."""
    path = fleet.tmp / f"digits-bad-int8-{measure}.mcpb"
    build_bundle(files.default, path, name="digits", version="1.0.0", labels_path=files.labels,
                 variants={"int8": VariantSource(files.nan, ("int8",))})  # fmt: skip
    _rewrite_variant(path, "int8", quantization={
        "scheme": "int8-static", "reference": "default", "samples": 200,
        "top1_agreement": 0.99, "max_abs_diff": 0.02, "accuracy_delta": None})  # fmt: skip
    sign_bundle(path, fleet.publisher, validate_models=False)
    ref = await fleet.publish(path)
    xeon = await fleet.device(f"dev-xeon-q{int(measure)}", profile("intel-xeon", measure=measure))

    await fleet.deploy(xeon, ref)

    version, probs = await answer(xeon.manager, digits)
    assert version == "1.0.0"
    assert_answers_like_fp32(probs, digits)
    info = install_info(xeon, "1.0.0")
    assert info["variant"] == "default"
    messages = xeon.sink.messages("1.0.0")
    if measure:
        trials = [t for t in info["choice"]["trials"] if t["variant"] == "int8"]
        assert trials and not any(t["ok"] for t in trials)
        assert all("NaN" in (t["reason"] or "") for t in trials), trials
        assert any(m.startswith("chose default") for m in messages), messages
    else:
        fallback = [m for m in messages if m.startswith("variant int8 failed")]
        assert fallback and "NaN" in fallback[0] and fallback[0].endswith("trying default")


async def test_a_bundle_whose_only_variant_fails_leaves_the_old_version_serving(
    fleet: Fleet, files: Files, digits: DigitsModels, tmp_path: Path
) -> None:
    xeon = await fleet.device("dev-xeon-5", profile("intel-xeon"))
    await fleet.deploy(xeon, await fleet.publish(make_bundle(files, fleet.tmp, "1.0.0",
                                                             fleet.publisher)))  # fmt: skip
    broken = tmp_path / "broken-1.1.0.mcpb"
    build_bundle(files.nan, broken, name="digits", version="1.1.0")
    sign_bundle(broken, fleet.publisher, validate_models=False)

    await fleet.deploy(xeon, await fleet.publish(broken))

    version, _ = await answer(xeon.manager, digits)
    assert version == "1.0.0"
    record = xeon.agent.store.record("digits")
    assert record is not None and record.phase is Phase.FAILED
    assert record.cause is Cause.LOAD_FAILED and "NaN" in (record.error or "")


async def test_a_publish_failing_half_way_lists_none_of_its_parts(
    fleet: Fleet, files: Files
) -> None:
    class RefusingDatabase(RepositoryService):
        async def _record(self, c: Any, actor: str) -> Any:
            raise UnavailableError("the database went away")

    db = Database(fleet.cp.settings.database_url)
    service = RefusingDatabase(fleet.cp.settings, db, fleet.cp.clock)
    bundle = make_bundle(files, fleet.tmp, "2.0.0", fleet.publisher)
    try:
        with pytest.raises(UnavailableError):
            await service.publish_bundle(bundle, actor="test")
    finally:
        await db.dispose()
    listed = [p for p in service.repo.targets().signed.targets if p.startswith("digits/2.0.0/")]
    assert listed == []
    assert list((fleet.cp.settings.data_dir / "uploads").iterdir()) == []

    status, answer_ = await fleet.cp.call("GET", "/api/v1/models/digits/versions/2.0.0")
    assert status == 404, answer_


async def test_a_crash_after_the_parts_are_staged_resumes_without_fetching_them_again(
    fleet: Fleet, files: Files, digits: DigitsModels
) -> None:
    ref = await fleet.publish(make_bundle(files, fleet.tmp, "1.0.0", fleet.publisher))
    xeon_size = part_lengths(fleet, ref)["models/model.xeon.onnx"]
    crashed = await fleet.device("dev-xeon-7", profile("intel-xeon"),
                                 phase_hook=crash_at(Phase.VERIFYING))  # fmt: skip
    with pytest.raises(Crash):
        await fleet.deploy(crashed, ref)
    record = crashed.agent.store.record("digits")
    assert record is not None and (record.phase, record.variant) == (Phase.VERIFYING, "xeon")

    before = fleet.bytes_sent()
    again = await fleet.restart(crashed)
    sent = fleet.bytes_sent() - before

    version, _ = await answer(again.manager, digits)
    assert version == "1.0.0"
    assert install_info(again, "1.0.0")["variant"] == "xeon"
    assert sent < xeon_size  # metadata only: the staged parts were reused
    assert list((fleet.tmp / "dev-xeon-7" / "staging").iterdir()) == []


async def test_a_crash_after_a_variant_failed_resumes_with_the_next_one(
    fleet: Fleet, files: Files, digits: DigitsModels
) -> None:
    ref = await fleet.publish(make_bundle(files, fleet.tmp, "1.0.0", fleet.publisher,
                                          xeon=files.nan))  # fmt: skip
    hook = crash_at(Phase.DOWNLOADING, lambda record: bool(record.failed_variants))
    crashed = await fleet.device("dev-xeon-8", profile("intel-xeon"), phase_hook=hook)
    with pytest.raises(Crash):
        await fleet.deploy(crashed, ref)
    record = crashed.agent.store.record("digits")
    assert record is not None and record.phase is Phase.DOWNLOADING
    assert set(record.failed_variants) == {"xeon"} and record.variant is None

    again = await fleet.restart(crashed)

    version, _ = await answer(again.manager, digits)
    assert version == "1.0.0"
    assert install_info(again, "1.0.0")["variant"] == "default"
    downloads = [m for m in again.sink.messages("1.0.0") if m.startswith("downloaded")]
    assert downloads and downloads[0].startswith("downloaded variant default")


# ---------------------------------------------------------------------- real processes


def _http_json(url: str, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return json.loads(r.read())


def _repo_bytes(cp_url: str) -> float:
    with urllib.request.urlopen(f"{cp_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("mcp_cp_repo_bytes_total "):
            return float(line.split()[1])
    return 0.0


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


@pytest.mark.timeout(300)
def test_mcp_agent_run_with_profile_intel_xeon_fetches_its_variant_from_the_control_plane(
    fresh_dynsec_broker: DynsecMosquittoBroker,
    files: Files,
    digits: DigitsModels,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> None:
    """``mcp-controlplane serve`` and ``mcp-agent run --profile intel-xeon`` as processes: the
    bundle has a default, a xeon variant and a large variant for another profile; the agent
    fetches what its profile needs and never the other profile's file."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def sh(*args: Any) -> str:
        done = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                              timeout=120, cwd=REPO, env=env)  # fmt: skip
        assert done.returncode == 0, f"{args[2:5]}: {done.stdout}\n{done.stderr}"
        return done.stdout

    data = tmp_path / "cp"
    api = init_control_plane(data, fresh_dynsec_broker, env=env)
    _, cp_url = serve_control_plane(data, processes, env=env)
    auth = ("--server", cp_url, "--token", api)
    key_path = tmp_path / "publisher.key"
    sh(*BUNDLE, "keygen", "--out", key_path)
    sh(*CP, "publishers", "add", key_path, "--name", "vision-team", *auth)
    jetson = padded(digits.onnx_path, tmp_path / "jetson.onnx", 250_000)
    bundle = tmp_path / "digits-1.0.0.mcpb"
    build_bundle(files.default, bundle, name="digits", version="1.0.0", labels_path=files.labels,
                 variants={"xeon": VariantSource(files.xeon, ("intel-xeon",)),
                           "orin": VariantSource(jetson, ("jetson-orin",))})  # fmt: skip
    sign_bundle(bundle, read_private_key(key_path), validate_models=False)
    sh(*BUNDLE, "push", bundle, *auth)

    token = sh(*CP, "tokens", "create", "--uses", "1", "--expires", "1h", *auth).strip()
    state = tmp_path / "agent"
    sh(*AGENT, "enroll", "--server", cp_url, "--token", token.splitlines()[-1],
       "--device-id", "xeon-1", "--state-dir", state, "--profile", "intel-xeon")  # fmt: skip
    port = free_port()
    with (tmp_path / "agent.log").open("w") as log:
        processes.append(subprocess.Popen(
            [*AGENT, "run", "--port", str(port), "--state-dir", str(state),
             "--profile", "intel-xeon", "--health-interval", "1"],
            stdout=subprocess.DEVNULL, stderr=log, text=True, cwd=REPO, env=env,
        ))  # fmt: skip
    devices = f"{cp_url}/api/v1/devices"
    wait_until(lambda: _http_json(devices, api)["items"][0].get("online"), "xeon-1 online", 90)

    before = _repo_bytes(cp_url)
    sh(*CP, "deploy", "digits", "1.0.0", "--device", "xeon-1", *auth)
    ready = f"http://127.0.0.1:{port}/v2/models/digits/ready"
    wait_until(lambda: _ready(ready), "digits 1.0.0 served by the agent", 120)
    sent = _repo_bytes(cp_url) - before

    info = json.loads((state / "models" / "digits" / "1.0.0" / "install.json").read_text())
    root = state / "models" / "digits" / "1.0.0"
    present = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert "models/model.orin.onnx" not in present
    sizes = {"xeon": files.xeon.stat().st_size, "default": files.default.stat().st_size}
    measured = load_profiles()["intel-xeon"].runtime.selection.measure
    needed = sizes["xeon"] + (sizes["default"] if measured else 0)
    assert info["variant"] in (("xeon", "default") if measured else ("xeon",))
    assert needed <= sent < bundle.stat().st_size, (sent, bundle.stat().st_size)

    def downloaded() -> list[dict[str, Any]]:
        items = _http_json(f"{cp_url}/api/v1/devices/xeon-1/events?limit=200", api)["items"]
        return [e for e in items if e["phase"] == "downloading" and e["outcome"] == "ok"]

    wait_until(downloaded, "the downloaded event at the control plane", 30)
    event = downloaded()[-1]
    assert event["bytes_total"] == bundle.stat().st_size
    assert needed <= event["bytes_done"] < bundle.stat().st_size
    print(
        f"\nmcp-agent --profile intel-xeon: repository sent {sent:.0f} bytes for a "
        f"{bundle.stat().st_size}-byte bundle (measured: {measured}); {event['message']}"
    )
