"""The pure parts of the control plane: the enrollment decision, settings, CLI parsing,
database URL mapping."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import click
import pytest

from mcp_edge.controlplane.cli.client import parse_duration, parse_labels
from mcp_edge.controlplane.db import DatabaseConfigError, async_url
from mcp_edge.controlplane.enrollment import (
    Action,
    Approval,
    DeviceStatus,
    Refusal,
    TokenFacts,
    default_device_id,
    merge_labels,
    plan,
)
from mcp_edge.controlplane.settings import (
    EnrollmentApproval,
    Settings,
    SettingsError,
    load_settings,
    write_config_file,
)
from mcp_edge.shared.protocol.state import DriftPolicy
from mcp_edge.shared.protocol.topics import validate_id
from mcp_edge.shared.signing import PrivateKey

NOW = datetime(2026, 5, 1, tzinfo=timezone.utc)


def token(**changes: object) -> TokenFacts:
    base: dict[str, object] = {
        "approval": Approval.AUTO,
        "uses": 0,
        "max_uses": None,
        "expires_at": None,
        "revoked_at": None,
    }
    base.update(changes)
    return TokenFacts(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("facts", "refusal"),
    [
        (None, Refusal.TOKEN_UNKNOWN),
        (token(revoked_at=NOW), Refusal.TOKEN_REVOKED),
        (token(expires_at=NOW), Refusal.TOKEN_EXPIRED),
        (token(expires_at=NOW - timedelta(seconds=1)), Refusal.TOKEN_EXPIRED),
        (token(uses=3, max_uses=3), Refusal.TOKEN_USED_UP),
    ],
)
def test_unusable_tokens_refuse_new_keys(facts: TokenFacts | None, refusal: Refusal) -> None:
    decision = plan(existing=None, token=facts, manual_policy=False, force=False, now=NOW)
    assert decision.action is Action.REFUSE and decision.refusal is refusal


@pytest.mark.parametrize(
    ("approval", "manual_policy", "status"),
    [
        (Approval.AUTO, False, DeviceStatus.ACCEPTED),
        (Approval.MANUAL, False, DeviceStatus.PENDING),
        (Approval.AUTO, True, DeviceStatus.PENDING),
    ],
)
def test_new_key_with_a_good_token(
    approval: Approval, manual_policy: bool, status: DeviceStatus
) -> None:
    facts = token(approval=approval, uses=2, max_uses=3, expires_at=NOW + timedelta(seconds=1))
    decision = plan(existing=None, token=facts, manual_policy=manual_policy, force=False, now=NOW)
    assert decision.action is Action.CREATE and decision.status is status


@pytest.mark.parametrize(
    ("existing", "force", "action"),
    [
        (DeviceStatus.ACCEPTED, False, Action.UNCHANGED),
        (DeviceStatus.ACCEPTED, True, Action.REENROLL),
        (DeviceStatus.PENDING, True, Action.UNCHANGED),
        (DeviceStatus.PREAUTHORIZED, False, Action.ACCEPT_PREAUTHORIZED),
        (DeviceStatus.REJECTED, True, Action.REFUSE),
        (DeviceStatus.REVOKED, True, Action.REFUSE),
    ],
)
def test_known_keys_decide_by_device_status_whatever_the_token(
    existing: DeviceStatus, force: bool, action: Action
) -> None:
    decision = plan(existing=existing, token=None, manual_policy=True, force=force, now=NOW)
    assert decision.action is action


def test_default_device_id_is_stable_and_topic_safe() -> None:
    key = PrivateKey.generate().public_key.raw.hex()
    assert default_device_id(key) == default_device_id(key)
    assert validate_id(default_device_id(key)) == default_device_id(key)


def test_operator_labels_win_over_device_labels() -> None:
    assert merge_labels({"site": "x", "cam": "2"}, {"site": "hq"}) == {"site": "hq", "cam": "2"}


def test_settings_round_trip_through_the_config_file(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        database_url="postgresql://cp@db/mcp",
        host="0.0.0.0",
        port=9000,
        broker_urls=("mqtts://a:8883", "mqtts://b:8883"),
        enrollment_approval=EnrollmentApproval.MANUAL,
    )
    path = write_config_file(settings)
    assert path.stat().st_mode & 0o777 == 0o600
    loaded = load_settings(tmp_path, environ={})
    assert loaded == settings
    env = {"MCP_LISTEN": "127.0.0.1:7000", "MCP_DATABASE_URL": "postgresql://x@y/z"}
    overridden = load_settings(tmp_path, environ=env, overrides={"listen": "[::1]:7001"})
    assert (overridden.host, overridden.port) == ("::1", 7001)
    assert overridden.database_url == "postgresql://x@y/z"


def test_the_drift_policy_comes_from_its_table_and_round_trips(tmp_path: Path) -> None:
    (tmp_path / "controlplane.toml").write_text(
        "[drift_policy]\nhard_examples = true\nwindow_requests = 50\nsample_every = 4\n"
    )
    loaded = load_settings(tmp_path, environ={})
    assert loaded.drift_policy == DriftPolicy(
        hard_examples=True, window_requests=50, sample_every=4
    )
    write_config_file(loaded)
    assert load_settings(tmp_path, environ={}) == loaded
    (tmp_path / "controlplane.toml").write_text("[drift_policy]\nwindow_requests = 5\n")
    with pytest.raises(SettingsError, match=r"drift_policy\.window_requests"):
        load_settings(tmp_path, environ={})
    with pytest.raises(SettingsError, match="drift_policy"):
        load_settings(tmp_path, environ={}, overrides={"drift_policy": {"nope": 1}})


def test_console_session_lifetime_is_configurable_and_bounded(tmp_path: Path) -> None:
    assert load_settings(tmp_path, environ={}).ui_session_hours == 12.0
    (tmp_path / "controlplane.toml").write_text("ui_session_hours = 2.5\n")
    assert load_settings(tmp_path, environ={}).ui_session_hours == 2.5
    with pytest.raises(SettingsError, match="ui_session_hours"):
        load_settings(tmp_path, environ={}, overrides={"ui_session_hours": 0})


def test_default_database_is_sqlite_in_the_data_dir(tmp_path: Path) -> None:
    settings = load_settings(tmp_path, environ={})
    assert settings.effective_database_url == f"sqlite:///{tmp_path.resolve()}/controlplane.db"


@pytest.mark.parametrize(
    "values", [{"listen": "nope"}, {"broker_urls": "broker:1883"}, {"enrollment_approval": "x"}]
)
def test_bad_settings_are_refused(tmp_path: Path, values: dict[str, str]) -> None:
    with pytest.raises(SettingsError):
        load_settings(tmp_path, environ={}, overrides=values)


@pytest.mark.parametrize(
    ("url", "driver"),
    [
        ("sqlite:////var/lib/cp.db", "sqlite+aiosqlite"),
        ("postgresql://cp@db/mcp", "postgresql+psycopg"),
        ("postgres://cp@db/mcp", "postgresql+psycopg"),
        ("postgresql+asyncpg://cp@db/mcp", "postgresql+asyncpg"),
    ],
)
def test_database_urls_map_to_async_drivers(url: str, driver: str) -> None:
    assert async_url(url).drivername == driver


@pytest.mark.parametrize("url", ["mysql://x@y/z", "sqlite://", "sqlite:///:memory:", "::"])
def test_unusable_database_urls_are_refused(url: str) -> None:
    with pytest.raises(DatabaseConfigError):
        async_url(url)


def test_durations_and_labels_from_the_command_line() -> None:
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("90s") == 90 and parse_duration("2w") == 14 * 86400
    assert parse_duration("never") is None
    with pytest.raises(click.BadParameter):
        parse_duration("7 days")
    assert parse_labels(["site=f1,line=a", "rack=3"]) == {"site": "f1", "line": "a", "rack": "3"}
    with pytest.raises(click.BadParameter):
        parse_labels(["nokey"])
