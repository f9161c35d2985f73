"""The pure parts of webhook delivery: the signature a receiver checks, the event document,
the retry schedule, event-type patterns, and the ``[[webhooks]]`` settings with their secret
files."""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime, timedelta, timezone
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_edge.controlplane.settings import (
    Settings,
    SettingsError,
    WebhookConfig,
    event_matches,
    load_settings,
    write_config_file,
)
from mcp_edge.controlplane.webhooks import (
    WebhookError,
    check_event_type,
    event_document,
    retry_delay_s,
    signature_header,
    verify_signature,
)

SECRET = b"s" * 32
BODY = b'{"id":"abc","type":"rollout.succeeded","created_at":"2026-05-01T12:00:00Z","data":{}}'
NOW = datetime(2026, 5, 1, 12, 0, tzinfo=timezone.utc)
T = int(NOW.timestamp())


# ---------------------------------------------------------------------------- signatures
def test_a_signed_body_verifies_and_the_header_is_stripes_shape() -> None:
    header = signature_header(SECRET, T, BODY)
    expected = hmac.new(SECRET, f"{T}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert header == f"t={T},v1={expected}"
    assert verify_signature(SECRET, header, BODY, NOW)
    assert verify_signature(SECRET.decode(), header, BODY, NOW.timestamp())


def test_a_tampered_body_is_refused() -> None:
    header = signature_header(SECRET, T, BODY)
    assert not verify_signature(SECRET, header, BODY.replace(b"succeeded", b"failed"), NOW)
    assert not verify_signature(SECRET, header, BODY + b" ", NOW)


def test_a_wrong_secret_is_refused() -> None:
    header = signature_header(SECRET, T, BODY)
    assert not verify_signature(b"t" * 32, header, BODY, NOW)
    assert not verify_signature(SECRET[:-1], header, BODY, NOW)


def test_an_old_or_future_timestamp_is_refused_past_the_tolerance() -> None:
    header = signature_header(SECRET, T, BODY)
    assert verify_signature(SECRET, header, BODY, NOW + timedelta(seconds=300))
    assert not verify_signature(SECRET, header, BODY, NOW + timedelta(seconds=301))
    assert not verify_signature(SECRET, header, BODY, NOW - timedelta(seconds=301))
    assert verify_signature(SECRET, header, BODY, NOW + timedelta(hours=1), tolerance_s=3600)


def test_a_replayed_signature_with_a_new_timestamp_is_refused() -> None:
    """Changing ``t`` to get past the tolerance breaks the MAC: the timestamp is signed."""
    mac = signature_header(SECRET, T, BODY).split("v1=")[1]
    later = T + 3600
    assert not verify_signature(SECRET, f"t={later},v1={mac}", BODY, NOW + timedelta(hours=1))


def test_any_listed_v1_signature_may_match_and_other_schemes_are_ignored() -> None:
    good = signature_header(SECRET, T, BODY).split("v1=")[1]
    assert verify_signature(SECRET, f"t={T},v0=zzz,v1={'0' * 64},v1={good}", BODY, NOW)
    assert not verify_signature(SECRET, f"t={T},v0={good}", BODY, NOW)


@pytest.mark.parametrize(
    "header",
    [
        "",
        "v1=" + "0" * 64,
        f"t={T}",
        f"t={T},t={T},v1=" + "0" * 64,
        "t=abc,v1=" + "0" * 64,
        "t=-5,v1=" + "0" * 64,
        "t=99999999999999999999,v1=" + "0" * 64,
        f"t={T},v1=" + "0" * 2000,
    ],
)
def test_malformed_headers_are_refused(header: str) -> None:
    assert not verify_signature(SECRET, header, BODY, NOW)


@given(st.text(max_size=300), st.binary(max_size=200))
def test_verification_never_raises(header: str, body: bytes) -> None:
    assert verify_signature(SECRET, header, body, NOW) in (True, False)


# ---------------------------------------------------------------------------- documents, retries
def test_the_event_document_carries_id_type_time_and_data() -> None:
    at = datetime(2026, 5, 1, 14, 0, 1, 250000, tzinfo=timezone(timedelta(hours=2)))
    doc = orjson.loads(event_document("e1", "rollout.paused", at, {"rollout": 7}))
    assert doc == {
        "id": "e1",
        "type": "rollout.paused",
        "created_at": "2026-05-01T12:00:01.250000Z",
        "data": {"rollout": 7},
    }


def test_retry_delays_double_from_one_second_to_an_hour_within_their_jitter() -> None:
    for attempts in range(1, 20):
        full = min(2.0 ** (attempts - 1), 3600.0)
        assert retry_delay_s(attempts, 0.0) == full / 2
        assert full / 2 <= retry_delay_s(attempts, 0.999) <= full
    assert retry_delay_s(1, 0.999) < 1.0
    assert retry_delay_s(13, 0.999) <= 3600.0
    assert retry_delay_s(40, 0.0) == 1800.0


@pytest.mark.parametrize(
    ("pattern", "event", "matches"),
    [
        ("*", "rollout.succeeded", True),
        ("rollout.*", "rollout.succeeded", True),
        ("rollout.*", "rollouts.succeeded", False),
        ("rollout.*", "drift.retraining_requested", False),
        ("rollout.succeeded", "rollout.succeeded", True),
        ("rollout.succeeded", "rollout.succeeded_twice", False),
        ("rollout.gate.*", "rollout.gate.failed", True),
    ],
)
def test_event_patterns(pattern: str, event: str, matches: bool) -> None:
    assert event_matches(pattern, event) is matches


@pytest.mark.parametrize("event", ["rollout", "Rollout.started", "rollout.*", "a..b", "x." * 40])
def test_malformed_event_types_are_refused(event: str) -> None:
    with pytest.raises(WebhookError, match="event type"):
        check_event_type(event)


# ---------------------------------------------------------------------------- settings
def _config(tmp_path: Path, text: str) -> Settings:
    data = tmp_path / "cp"
    data.mkdir(exist_ok=True)
    (data / "controlplane.toml").write_text(text)
    return load_settings(data, environ={})


def test_webhooks_are_read_from_the_config_file_with_their_defaults(tmp_path: Path) -> None:
    settings = _config(
        tmp_path,
        '[[webhooks]]\nname = "ops"\nurl = "https://hooks.example/mcp"\n'
        'secret_file = "/etc/mcp/ops.secret"\n\n'
        '[[webhooks]]\nname = "ml-team"\nurl = "http://10.0.0.5:9000/in"\n'
        'secret_file = "/etc/mcp/ml.secret"\nevents = ["drift.*", "rollout.succeeded"]\n'
        "timeout_s = 2\nmax_attempts = 3\n",
    )
    ops, ml = settings.webhooks
    assert ops == WebhookConfig("ops", "https://hooks.example/mcp", Path("/etc/mcp/ops.secret"))
    assert (ops.events, ops.timeout_s, ops.max_attempts) == (("*",), 5.0, 12)
    assert ml.events == ("drift.*", "rollout.succeeded")
    assert (ml.timeout_s, ml.max_attempts) == (2.0, 3)
    assert ml.accepts("drift.retraining_requested") and ml.accepts("rollout.succeeded")
    assert not ml.accepts("rollout.stage_started")


def test_write_config_file_keeps_the_webhooks(tmp_path: Path) -> None:
    hook = WebhookConfig("ops", "https://h.example/x", tmp_path / "s", ("rollout.*",), 2.5, 4)
    settings = Settings(data_dir=tmp_path, webhooks=(hook,))
    write_config_file(settings)
    assert load_settings(tmp_path, environ={}).webhooks == (hook,)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('name = "ops"\nurl = "ftp://h/x"\nsecret_file = "/s"', "must start with http"),
        ('name = "ops"\nurl = "file:///etc/passwd"\nsecret_file = "/s"', "must start with http"),
        ('name = "ops"\nurl = "https:///x"\nsecret_file = "/s"', "names no host"),
        ('name = "ops"\nurl = "https://u:p@h/x"\nsecret_file = "/s"', "credentials"),
        ('name = "ops"\nurl = "https://h:99999/x"\nsecret_file = "/s"', "does not parse"),
        ('name = "ops"\nurl = "https://h/ x"\nsecret_file = "/s"', "spaces"),
        ('name = "ops"\nsecret_file = "/s"', "url is missing"),
        ('name = "ops"\nurl = "https://h/x"', "secret_file"),
        ('name = "o ps"\nurl = "https://h/x"\nsecret_file = "/s"', "name 'o ps'"),
        ('url = "https://h/x"\nsecret_file = "/s"', "name None"),
        ('name = "ops"\nurl = "https://h/x"\nsecret = "/s"', "unknown key"),
        ('name = "ops"\nurl = "https://h/x"\nsecret_file = "/s"\nevents = []', "events is empty"),
        ('name = "ops"\nurl = "https://h/x"\nsecret_file = "/s"\nevents = ["ro*"]', "pattern"),
        ('name = "ops"\nurl = "https://h/x"\nsecret_file = "/s"\nevents = "*"', "list"),
        ('name = "ops"\nurl = "https://h/x"\nsecret_file = "/s"\ntimeout_s = 0', "timeout_s"),
        ('name = "ops"\nurl = "https://h/x"\nsecret_file = "/s"\ntimeout_s = "5"', "timeout_s"),
        ('name = "ops"\nurl = "https://h/x"\nsecret_file = "/s"\nmax_attempts = 0', "max_attempts"),
        ('name = "ops"\nurl = "https://h/x"\nsecret_file = "/s"\nmax_attempts = 2.5', "integer"),
    ],
)
def test_bad_webhook_entries_are_refused_naming_the_problem(
    tmp_path: Path, entry: str, message: str
) -> None:
    with pytest.raises(SettingsError, match=message) as info:
        _config(tmp_path, f"[[webhooks]]\n{entry}\n")
    assert "controlplane.toml" in str(info.value)


def test_two_webhooks_may_not_share_a_name(tmp_path: Path) -> None:
    entry = '[[webhooks]]\nname = "ops"\nurl = "https://h/x"\nsecret_file = "/s"\n'
    with pytest.raises(SettingsError, match="used twice: ops"):
        _config(tmp_path, entry + entry)


def test_webhooks_must_be_tables(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="list of tables"):
        _config(tmp_path, 'webhooks = "https://h/x"\n')


def _secret(tmp_path: Path, content: bytes, mode: int = 0o600) -> WebhookConfig:
    path = tmp_path / "hook.secret"
    path.write_bytes(content)
    path.chmod(mode)
    return WebhookConfig("ops", "https://h/x", path)


def test_the_secret_is_the_file_less_its_trailing_newline(tmp_path: Path) -> None:
    assert _secret(tmp_path, b"k" * 64 + b"\n").read_secret() == b"k" * 64
    assert _secret(tmp_path, b"k" * 32, 0o640).read_secret() == b"k" * 32


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        (b"short\n", 0o600, "holds 5 bytes; a webhook secret needs at least 32"),
        (b"k" * 5000, 0o600, "larger than 4096"),
        (b"k" * 64, 0o644, "permissions 0644; others must have no access"),
        (b"k" * 64, 0o602, "permissions 0602"),
    ],
)
def test_unusable_secret_files_are_refused(
    tmp_path: Path, content: bytes, mode: int, message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        _secret(tmp_path, content, mode).read_secret()


def test_a_missing_secret_file_or_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot be read"):
        WebhookConfig("ops", "https://h/x", tmp_path / "absent").read_secret()
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(SettingsError, match="not a regular file"):
        WebhookConfig("ops", "https://h/x", tmp_path / "dir").read_secret()
