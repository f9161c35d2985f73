"""The model registry end to end: publisher keys, publishing signed bundles over REST, the TUF
repository served at ``/repo/...`` and read by python-tuf's own client, key rotation from the
command line, the trust root in enrollment answers, and ``mcp-bundle push``.

Each app runs on a fresh database (SQLite, and PostgreSQL when ``MCP_TEST_POSTGRES_URL`` is
set) with a real data dir; bundles are built from the `digits` model and signed for real.
The app's clock is the wall clock (fixed at the start of each test) because ngclient checks
metadata expiry against the real time.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tarfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner
from tuf.ngclient.updater import Updater

from mcp_edge.agent.update.transport_http import HttpRepoTransport
from mcp_edge.controlplane.app import create_app
from mcp_edge.controlplane.bootstrap import initialize
from mcp_edge.controlplane.cli import main as controlplane_cli
from mcp_edge.controlplane.settings import PasswordCost, Settings, SettingsError, load_settings
from mcp_edge.shared.bundle import build_bundle, sign_bundle
from mcp_edge.shared.bundle_cli import cli as bundle_cli
from mcp_edge.shared.signing import PrivateKey, write_public_key
from mcp_edge.tooling.models import DigitsModels
from tests.support.controlplane import (
    ADMIN_PASSWORD,
    ControlPlane,
    FakeClock,
    FakeProvisioner,
    served,
    start_control_plane,
)

TARGET = "digits/1.0.0/digits-1.0.0.mcpb"


@dataclass(frozen=True)
class Bundles:
    """Signed and unsigned digits bundles and the keys that signed them."""

    publisher: PrivateKey
    stranger: PrivateKey
    signed: Path  # digits 1.0.0 by publisher
    other_bytes: Path  # digits 1.0.0 by publisher, different bytes
    unsigned: Path  # digits 1.1.0, no signature
    by_stranger: Path  # digits 1.2.0 by an unregistered key
    second: Path  # digits 1.3.0 by publisher, with an rpi variant


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory, digits: DigitsModels) -> Bundles:
    out = tmp_path_factory.mktemp("bundles")
    publisher, stranger = PrivateKey.generate(), PrivateKey.generate()
    created = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def make(version: str, key: PrivateKey | None, **kwargs: Any) -> Path:
        path = out / f"digits-{version}-{len(list(out.iterdir()))}.mcpb"
        build_bundle(
            digits.onnx_path, path, name="digits", version=version, created=created, **kwargs
        )
        if key is not None:
            sign_bundle(path, key, validate_models=False)
        return path

    from mcp_edge.shared.bundle import VariantSource

    return Bundles(
        publisher=publisher,
        stranger=stranger,
        signed=make("1.0.0", publisher),
        other_bytes=make("1.0.0", publisher, metadata={"build": "2"}),
        unsigned=make("1.1.0", None),
        by_stranger=make("1.2.0", stranger),
        second=make(
            "1.3.0",
            publisher,
            variants={"rpi": VariantSource(digits.tflite_path, ("raspberry-pi", "generic-arm64"))},
        ),
    )


MakeControlPlane = Callable[..., Awaitable[ControlPlane]]


@pytest.fixture
async def make_cp(database_url: str, tmp_path: Path) -> AsyncIterator[MakeControlPlane]:
    clients: list[TestClient[Any, Any]] = []

    async def make(**overrides: Any) -> ControlPlane:
        settings = Settings(
            data_dir=tmp_path / "cp",
            database_url=database_url,
            password_cost=PasswordCost.MIN,
            **overrides,
        )
        cp = await start_control_plane(
            settings, FakeClock(datetime.now(timezone.utc).replace(microsecond=0))
        )
        clients.append(cp.client)
        return cp

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def cp(make_cp: MakeControlPlane) -> ControlPlane:
    return await make_cp()


async def add_publisher(cp: ControlPlane, key: PrivateKey, name: str = "vision") -> dict[str, Any]:
    status, row = await cp.call(
        "POST", "/api/v1/publishers", body={"name": name, "public_key": key.public_key.raw.hex()}
    )
    assert status == 201, row
    return dict(row)


async def push(cp: ControlPlane, bundle: Path, token: str | None = "admin") -> tuple[int, Any]:
    return await cp.call(
        "POST",
        "/api/v1/bundles",
        raw=bundle.read_bytes(),
        token=token,
        headers={"Content-Type": "application/octet-stream"},
    )


async def metadata(cp: ControlPlane, name: str) -> dict[str, Any]:
    async with cp.client.get(f"/repo/metadata/{name}") as response:
        assert response.status == 200, await response.text()
        return dict(json.loads(await response.read()))


async def current_targets(cp: ControlPlane) -> dict[str, Any]:
    timestamp = await metadata(cp, "timestamp.json")
    snapshot = await metadata(
        cp, f"{timestamp['signed']['meta']['snapshot.json']['version']}.snapshot.json"
    )
    version = snapshot["signed"]["meta"]["targets.json"]["version"]
    return dict((await metadata(cp, f"{version}.targets.json"))["signed"])


def repo_url(cp: ControlPlane) -> str:
    return str(cp.client.make_url("/repo")).rstrip("/")


def tuf_client(cp: ControlPlane, trust_dir: Path, root: bytes | None = None) -> Updater:
    """python-tuf's own client over the app's /repo routes (its default urllib3 fetcher)."""
    (trust_dir / "metadata").mkdir(parents=True, exist_ok=True)
    (trust_dir / "targets").mkdir(exist_ok=True)
    if root is not None:
        (trust_dir / "metadata" / "root.json").write_bytes(root)
    base = repo_url(cp)
    return Updater(
        str(trust_dir / "metadata"),
        f"{base}/metadata/",
        str(trust_dir / "targets"),
        f"{base}/targets/",
        bootstrap=None,
    )


def bundle_members(bundle: Path) -> dict[str, bytes]:
    """Every member of a bundle by name (the test's own tar reader, for comparison)."""
    with tarfile.open(bundle) as tar:
        return {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile()
        }


def download(updater: Updater, target: str) -> tuple[dict[str, Any], bytes]:
    """Refresh, then fetch and verify ``target``; returns its custom fields and bytes."""
    updater.refresh()
    info = updater.get_targetinfo(target)
    assert info is not None, f"{target} is not listed"
    path = updater.download_target(info)
    return dict(info.custom), Path(path).read_bytes()


# ---------------------------------------------------------------------------- publishing
async def test_publish_list_and_download_with_the_tuf_client(
    cp: ControlPlane, bundles: Bundles, tmp_path: Path
) -> None:
    publisher = await add_publisher(cp, bundles.publisher)
    assert publisher["keyid"] == bundles.publisher.keyid and not publisher["revoked"]

    status, version = await push(cp, bundles.signed)
    assert status == 201, version
    data = bundles.signed.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    assert version["model"] == "digits" and version["version"] == "1.0.0"
    assert version["sha256"] == sha and version["length"] == len(data)
    assert version["target_path"] == TARGET and version["signer"] == bundles.publisher.keyid
    assert version["uploaded_by"] == "user:admin" and version["format"] == "onnx"
    assert version["variants"][0]["name"] == "default" and version["profiles"] == []

    status, second = await push(cp, bundles.second)
    assert status == 201, second
    assert second["profiles"] == ["generic-arm64", "raspberry-pi"]
    assert {v["name"] for v in second["variants"]} == {"default", "rpi"}

    status, listing = await cp.call("GET", "/api/v1/models")
    assert status == 200
    assert [(m["name"], m["version_count"], m["latest_version"]) for m in listing["items"]] == [
        ("digits", 2, "1.3.0")
    ]
    status, detail = await cp.call("GET", "/api/v1/models/digits")
    assert status == 200 and [v["version"] for v in detail["versions"]] == ["1.3.0", "1.0.0"]
    status, one = await cp.call("GET", "/api/v1/models/digits/versions/1.0.0")
    assert status == 200 and one == version
    status, missing = await cp.call("GET", "/api/v1/models/digits/versions/9.9.9")
    assert status == 404 and "9.9.9" in missing["error"]
    status, _ = await cp.call("GET", "/api/v1/models/nope")
    assert status == 404

    targets = await current_targets(cp)
    entry = targets["targets"][TARGET]
    assert entry["length"] == len(data) and entry["hashes"] == {"sha256": sha}
    assert entry["custom"] == {
        "model": "digits",
        "version": "1.0.0",
        "version_numeric": 10000009,
        "format": "onnx",
        "profiles": [],
        "publisher": bundles.publisher.keyid,
        "variants": [{k: v for k, v in version["variants"][0].items()}],
        "parts": {
            "manifest": "digits/1.0.0/manifest.json",
            "signature": "digits/1.0.0/manifest.sig",
            "files": {"models/model.onnx": "digits/1.0.0/models/model.onnx"},
        },
    }
    assert targets["x-mcp-publishers"] == {
        bundles.publisher.keyid: bundles.publisher.public_key.raw.hex()
    }

    root = (cp.settings.data_dir / "repository" / "metadata" / "1.root.json").read_bytes()
    updater = tuf_client(cp, tmp_path / "device", root)
    custom, fetched = await asyncio.to_thread(download, updater, TARGET)
    assert fetched == data and custom["publisher"] == bundles.publisher.keyid
    # each member is a target of its own, with the bytes the bundle holds
    members = bundle_members(bundles.signed)
    for member, target in [("manifest.json", "digits/1.0.0/manifest.json"),
                           ("manifest.sig", "digits/1.0.0/manifest.sig"),
                           ("models/model.onnx", "digits/1.0.0/models/model.onnx")]:  # fmt: skip
        part_info = updater.get_targetinfo(target)
        assert part_info is not None, f"{target} is not listed"
        part_custom = dict(part_info.custom)
        part = Path(await asyncio.to_thread(updater.download_target, part_info)).read_bytes()
        assert part == members[member]
        assert part_custom == {"model": "digits", "version": "1.0.0", "part_of": TARGET}

    async with cp.client.get(
        f"/repo/targets/digits/1.0.0/{sha}.digits-1.0.0.mcpb", headers={"Range": "bytes=512-1023"}
    ) as response:
        assert response.status == 206 and await response.read() == data[512:1024]

    status, repo = await cp.call("GET", "/api/v1/repository")
    # two bundles: 1.0.0 with manifest, signature and one model; 1.3.0 with two models
    assert status == 200 and repo["targets"] == 4 + 5 and repo["root_key_online"] is True
    assert {r["role"]: r["version"] for r in repo["roles"]}["root"] == 1
    assert repo["publishers"] == [bundles.publisher.keyid]

    status, log = await cp.call(
        "GET", "/api/v1/audit", params={"action": "model_version.published"}
    )
    assert status == 200 and {e["target_id"] for e in log["items"]} == {
        "digits@1.0.0",
        "digits@1.3.0",
    }


async def test_the_agents_http_transport_reads_the_control_planes_repo_routes(
    cp: ControlPlane, bundles: Bundles, tmp_path: Path
) -> None:
    """`mcp-agent run --repo http://cp/repo`: ngclient through HttpRepoTransport, and a download
    that resumes from a partial file with a Range request, verified by TUF."""
    await add_publisher(cp, bundles.publisher)
    status, version = await push(cp, bundles.signed)
    assert status == 201, version
    data = bundles.signed.read_bytes()
    transport = HttpRepoTransport(repo_url(cp))
    device = tmp_path / "device"
    device.mkdir()
    root = (cp.settings.data_dir / "repository" / "metadata" / "root.json").read_bytes()

    def fetch() -> tuple[int, bytes]:
        updater = Updater(str(device), transport.metadata_url, target_base_url=transport.targets_url,
                          fetcher=transport.fetcher(), bootstrap=root)  # fmt: skip
        updater.refresh()
        info = updater.get_targetinfo(TARGET)
        assert info is not None
        dest = tmp_path / "partial.mcpb"
        dest.write_bytes(data[:1000])  # an earlier, interrupted download
        url = f"{transport.targets_url}digits/1.0.0/{info.hashes['sha256']}.digits-1.0.0.mcpb"
        sent = transport.download(url, dest, length=info.length)
        with dest.open("rb") as f:
            info.verify_length_and_hashes(f)
        return sent, dest.read_bytes()

    sent, fetched = await asyncio.to_thread(fetch)
    assert fetched == data and sent == len(data) - 1000


async def test_unsigned_unknown_and_revoked_signers_are_refused(
    cp: ControlPlane, bundles: Bundles
) -> None:
    status, answer = await push(cp, bundles.signed)
    assert status == 403 and "not a registered publisher key" in answer["error"]

    await add_publisher(cp, bundles.publisher)
    status, answer = await push(cp, bundles.unsigned)
    assert status == 400 and "not signed" in answer["error"]
    status, answer = await push(cp, bundles.by_stranger)
    assert status == 403 and bundles.stranger.keyid[:16] in answer["error"]
    status, answer = await cp.call(
        "POST",
        "/api/v1/bundles",
        raw=b"not a tar" * 200,
        headers={"Content-Type": "application/octet-stream"},
    )
    assert status == 400 and answer["error"].startswith("bundle refused")
    status, answer = await cp.call("POST", "/api/v1/bundles", body={"bundle": "json"})
    assert status == 415

    viewer = await cp.user_token("watcher", "viewer")
    status, _ = await push(cp, bundles.signed, token=viewer)
    assert status == 403
    status, _ = await cp.call(
        "POST", "/api/v1/publishers", token=viewer, body={"name": "x", "public_key": "ab" * 32}
    )
    assert status == 403

    status, revoked = await cp.call("DELETE", f"/api/v1/publishers/{bundles.publisher.keyid}")
    assert status == 200 and revoked["revoked"] and revoked["revoked_at"]
    status, answer = await push(cp, bundles.signed)
    assert status == 403 and "revoked" in answer["error"]
    assert (await current_targets(cp))["x-mcp-publishers"] == {}
    status, answer = await cp.call(
        "POST",
        "/api/v1/publishers",
        body={"name": "again", "public_key": bundles.publisher.public_key.raw.hex()},
    )
    assert status == 409 and "revoked" in answer["error"]
    status, again = await cp.call("DELETE", f"/api/v1/publishers/{bundles.publisher.keyid}")
    assert status == 200 and again["revoked_at"] == revoked["revoked_at"]
    status, _ = await cp.call("DELETE", "/api/v1/publishers/" + "0" * 64)
    assert status == 404

    status, listing = await cp.call("GET", "/api/v1/models")
    assert status == 200 and listing["items"] == []
    assert (await current_targets(cp))["targets"] == {}
    status, keys = await cp.call("GET", "/api/v1/publishers")
    assert [(k["name"], k["revoked"]) for k in keys["items"]] == [("vision", True)]


async def test_same_bundle_twice_is_a_no_op_and_other_bytes_conflict(
    cp: ControlPlane, bundles: Bundles
) -> None:
    await add_publisher(cp, bundles.publisher)
    status, first = await push(cp, bundles.signed)
    assert status == 201, first
    targets_before = await current_targets(cp)

    status, again = await push(cp, bundles.signed)
    assert status == 200 and again == first
    assert await current_targets(cp) == targets_before

    status, answer = await push(cp, bundles.other_bytes)
    assert status == 409 and "already published" in answer["error"]
    assert await current_targets(cp) == targets_before
    status, log = await cp.call(
        "GET", "/api/v1/audit", params={"action": "model_version.published"}
    )
    assert len(log["items"]) == 1


async def test_an_oversized_upload_is_refused_with_413(
    make_cp: MakeControlPlane, bundles: Bundles
) -> None:
    cap = 16 * 1024
    cp = await make_cp(max_bundle_bytes=cap)
    await add_publisher(cp, bundles.publisher)
    assert bundles.signed.stat().st_size > cap
    status, answer = await push(cp, bundles.signed)
    assert status == 413 and str(cap) in answer["error"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: caught while streaming
        data = bundles.signed.read_bytes()[: cap * 2]
        for i in range(0, len(data), 4096):
            yield data[i : i + 4096]

    status, answer = await cp.call(
        "POST",
        "/api/v1/bundles",
        raw=chunks(),  # type: ignore[arg-type]
        headers={"Content-Type": "application/octet-stream"},
    )
    assert status == 413 and "max_bundle_bytes" in answer["error"]
    assert list((cp.settings.data_dir / "uploads").iterdir()) == []
    status, listing = await cp.call("GET", "/api/v1/models")
    assert listing["items"] == []


async def test_repo_routes_serve_only_repository_files(cp: ControlPlane, tmp_path: Path) -> None:
    root = cp.settings.data_dir / "repository"
    outside = tmp_path / "secret.txt"
    outside.write_text("not for devices")
    (root / "targets" / "escape").symlink_to(outside)
    (root / "targets" / "dir").symlink_to(tmp_path)

    async def get(path: str) -> tuple[int, bytes]:
        async with cp.client.get(path) as response:
            return response.status, await response.read()

    status, body = await get("/repo/metadata/root.json")
    assert status == 200 and json.loads(body)["signed"]["_type"] == "root"
    for path in [
        "/repo/targets/%2e%2e/%2e%2e/keys/root.key",
        "/repo/targets/..%2F..%2Fkeys%2Froot.key",
        "/repo/metadata/%2e%2e%2fkeys%2froot.key",
        "/repo/targets/.lock",
        "/repo/metadata/.root.json.tmp",
    ]:
        status, body = await get(path)
        assert status in (400, 404), (path, status)
        assert b"private" not in body and "error" in json.loads(body)
    for path in [
        "/repo/targets/escape",
        "/repo/targets/dir/secret.txt",
        "/repo/metadata/99.root.json",
    ]:
        status, body = await get(path)
        assert status == 404 and "error" in json.loads(body), path


async def test_the_http_repository_can_be_switched_off(make_cp: MakeControlPlane) -> None:
    cp = await make_cp(repository_http=False)
    async with cp.client.get("/repo/metadata/root.json") as response:
        assert response.status == 403
        assert "repository_http = false" in (await response.json())["error"]
    status, repo = await cp.call("GET", "/api/v1/repository")  # the repository itself is there
    assert status == 200 and {r["role"] for r in repo["roles"]} >= {"root", "timestamp"}


# ---------------------------------------------------------------------------- keys and trust
async def test_root_rotation_is_followed_by_a_client_that_trusted_the_old_root(
    cp: ControlPlane, bundles: Bundles, tmp_path: Path
) -> None:
    await add_publisher(cp, bundles.publisher)
    status, _ = await push(cp, bundles.signed)
    assert status == 201
    data_dir = cp.settings.data_dir
    old_root = (data_dir / "repository" / "metadata" / "root.json").read_bytes()
    device = tmp_path / "device"
    updater = tuf_client(cp, device, old_root)
    await asyncio.to_thread(download, updater, TARGET)

    def cli(*args: str) -> Any:
        result = CliRunner().invoke(controlplane_cli, [*args, "--data-dir", str(data_dir)])
        return result

    offline = tmp_path / "offline-root.key"
    result = cli("keys", "export-root", str(offline), "--remove")
    assert result.exit_code == 0, result.output
    result = cli("keys", "rotate", "root")
    assert result.exit_code == 1 and "import-root" in result.output
    result = cli("keys", "import-root", str(offline))
    assert result.exit_code == 0, result.output
    result = cli("keys", "rotate", "root")
    assert result.exit_code == 0 and "version 2" in result.output, result.output
    result = cli("keys", "rotate", "targets")
    assert result.exit_code == 0 and "version 3" in result.output, result.output
    result = cli("keys", "show")
    assert result.exit_code == 0 and "online" in result.output, result.output

    updater = tuf_client(cp, device)  # a restarted device: trusts only what it stored
    custom, fetched = await asyncio.to_thread(download, updater, TARGET)
    assert fetched == bundles.signed.read_bytes() and custom["version"] == "1.0.0"
    trusted = json.loads((device / "metadata" / "root.json").read_bytes())
    assert trusted["signed"]["version"] == 3

    status, repo = await cp.call("GET", "/api/v1/repository")
    assert {r["role"]: r["version"] for r in repo["roles"]}["root"] == 3


async def test_enrollment_answer_carries_the_real_trust_root(
    cp: ControlPlane, bundles: Bundles
) -> None:
    await add_publisher(cp, bundles.publisher)
    token = await cp.new_token()
    status, answer = await cp.enroll(PrivateKey.generate(), token["token"])
    assert status == 200, answer
    trust = answer["trust"]
    assert trust["tuf_root"] == await metadata(cp, "root.json")
    director = (cp.settings.data_dir / "keys" / "director.key").read_text()
    assert trust["director_keys"] == [json.loads(director)["public"]]
    assert trust["publisher_keys"] == [bundles.publisher.public_key.raw.hex()]


async def test_a_restart_after_downtime_re_signs_metadata_near_expiry(cp: ControlPlane) -> None:
    before = (await metadata(cp, "timestamp.json"))["signed"]
    cp.clock.advance(hours=13)  # the 1-day timestamp has less than half its life left
    client: TestClient[Any, Any] = TestClient(
        TestServer(create_app(cp.settings, FakeProvisioner(), cp.clock))
    )
    await client.start_server()
    try:
        async with client.get("/repo/metadata/timestamp.json") as response:
            after = json.loads(await response.read())["signed"]
    finally:
        await client.close()
    assert after["version"] == before["version"] + 1
    assert after["expires"] > before["expires"]


def test_repository_settings_come_from_the_config_file_and_environment(tmp_path: Path) -> None:
    (tmp_path / "controlplane.toml").write_text(
        "timestamp_refresh_s = 600\nmax_bundle_bytes = 1048576\n"
    )
    settings = load_settings(tmp_path, environ={})
    assert (settings.timestamp_refresh_s, settings.max_bundle_bytes) == (600.0, 1 << 20)
    settings = load_settings(
        tmp_path, environ={"MCP_TIMESTAMP_REFRESH_S": "30", "MCP_MAX_BUNDLE_BYTES": "4096"}
    )
    assert (settings.timestamp_refresh_s, settings.max_bundle_bytes) == (30.0, 4096)
    assert load_settings(tmp_path / "none", environ={}).max_bundle_bytes == 2 << 30
    with pytest.raises(SettingsError, match="timestamp_refresh_s"):
        load_settings(tmp_path, environ={"MCP_TIMESTAMP_REFRESH_S": "0"})
    with pytest.raises(SettingsError, match="max_bundle_bytes"):
        load_settings(tmp_path, environ={"MCP_MAX_BUNDLE_BYTES": "ten"})
    assert load_settings(tmp_path, environ={}).repository_http is True
    assert (
        load_settings(tmp_path, environ={"MCP_REPOSITORY_HTTP": "false"}).repository_http is False
    )
    (tmp_path / "controlplane.toml").write_text("repository_http = false\n")
    assert load_settings(tmp_path, environ={}).repository_http is False
    with pytest.raises(SettingsError, match="repository_http"):
        load_settings(tmp_path, environ={"MCP_REPOSITORY_HTTP": "maybe"})


# ---------------------------------------------------------------------------- command line
def test_cli_publishers_push_with_progress_and_models(tmp_path: Path, bundles: Bundles) -> None:
    settings = Settings(
        data_dir=tmp_path / "cp",
        database_url=f"sqlite:///{tmp_path / 'cp.db'}",
        password_cost=PasswordCost.MIN,
        port=0,
    )
    result = asyncio.run(
        initialize(
            settings,
            clock=lambda: datetime.now(timezone.utc),
            admin_user="admin",
            admin_password=ADMIN_PASSWORD,
        )
    )
    token = result.api_token
    assert token is not None
    pub = tmp_path / "publisher.pub"
    write_public_key(pub, bundles.publisher.public_key)
    runner = CliRunner()
    with served(settings, FakeProvisioner()) as url:
        auth = ["--server", url, "--token", token]

        def cp(*args: str) -> Any:
            return runner.invoke(controlplane_cli, [*args, *auth])

        def bundle(*args: str) -> Any:
            return runner.invoke(bundle_cli, [*args, *auth])

        added = cp("publishers", "add", str(pub), "--name", "vision")
        assert added.exit_code == 0 and bundles.publisher.keyid in added.output, added.output
        listed = cp("publishers", "list")
        assert "vision" in listed.output and bundles.publisher.keyid in listed.output

        pushed = bundle("push", str(bundles.signed), "--progress")
        assert pushed.exit_code == 0, pushed.output
        assert "published digits 1.0.0" in pushed.stdout and TARGET in pushed.stdout
        assert "push" in pushed.stderr and "100%" in pushed.stderr
        again = bundle("push", str(bundles.signed), "--no-progress")
        assert again.exit_code == 0 and "nothing changed" in again.stdout
        conflict = bundle("push", str(bundles.other_bytes))
        assert conflict.exit_code == 1 and "HTTP 409" in conflict.stderr
        stranger = bundle("push", str(bundles.by_stranger))
        assert stranger.exit_code == 1 and "not a registered publisher key" in stranger.stderr
        unsigned = bundle("push", str(bundles.unsigned))
        assert unsigned.exit_code == 1 and "not signed" in unsigned.stderr
        bad_token = runner.invoke(
            bundle_cli, ["push", str(bundles.signed), "--server", url, "--token", "mcpa_wrong"]
        )
        assert bad_token.exit_code == 1 and "HTTP 401" in bad_token.stderr

        models = cp("models", "list")
        assert models.exit_code == 0 and "digits" in models.output and "1.0.0" in models.output
        shown = cp("models", "show", "digits")
        assert (
            shown.exit_code == 0
            and hashlib.sha256(bundles.signed.read_bytes()).hexdigest()[:16] in shown.output
        )
        missing = cp("models", "show", "nope")
        assert missing.exit_code == 1 and "no model" in missing.output

        revoked = cp("publishers", "revoke", bundles.publisher.keyid)
        assert revoked.exit_code == 0 and "revoked" in revoked.output
        refused = bundle("push", str(bundles.second))
        assert refused.exit_code == 1 and "revoked" in refused.stderr
