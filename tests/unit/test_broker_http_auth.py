"""The pure half of the HTTP broker accounts: password hashes, filter coverage, what each kind
of account may do (the same literal topics as Mosquitto's dynamic security), and the settings
that choose the provisioner and hold the brokers' secret."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_edge.controlplane.broker.acl import (
    AccountSpec,
    AclType,
    app_client_account,
    device_account,
    service_account,
)
from mcp_edge.controlplane.broker.grants import Access, Grant, filter_covers, valid_subscription
from mcp_edge.controlplane.broker.http_auth import hash_password, verify_password
from mcp_edge.controlplane.settings import (
    BrokerProvisionerKind,
    Settings,
    SettingsError,
    load_settings,
    write_config_file,
)
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.topics import TelemetryKind

SECRET = "0123456789abcdef" * 4


def grant_of(spec: AccountSpec) -> Grant:
    return Grant(spec.username, spec.acls)


# ---------------------------------------------------------------------------- passwords
def test_password_hashes_are_salted_scrypt_and_verify_only_their_password() -> None:
    first, second = hash_password("s3cret"), hash_password("s3cret")
    assert first.startswith("scrypt$12$8$1$") and first != second  # a fresh salt each time
    assert verify_password("s3cret", first) and verify_password("s3cret", second)
    assert not verify_password("s3cret!", first)
    assert "s3cret" not in first


@pytest.mark.parametrize(
    "damaged",
    ["", "scrypt", "bcrypt$12$8$1$AAAA$AAAA", "scrypt$99$8$1$AAAA$AAAA", "scrypt$x$8$1$A$A",
     "scrypt$12$8$1$%%%$AAAA"],
)  # fmt: skip
def test_a_damaged_hash_denies_instead_of_failing(damaged: str) -> None:
    assert verify_password("anything", damaged) is False


# ---------------------------------------------------------------------------- filter coverage
@pytest.mark.parametrize(
    ("pattern", "requested", "covered"),
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/+", True),
        ("a/#", "a", True),  # '#' also matches the parent level
        ("a/#", "a/+/c", True),
        ("a/#", "a/#", True),
        ("a/b", "a/+", False),  # the request is wider than the ACL
        ("a/+", "a/#", False),
        ("a/+", "a/b/c", False),
        ("a/b/c", "a/b", False),
        ("+/b", "$SYS/b", False),  # a leading wildcard never covers a $ topic
        ("$share/+/a/#", "$share/g/a/+", True),
        ("$share/+/a/#", "$share/+/a/b", True),
        ("$share/g/a/+", "$share/h/a/b", False),
        ("$share/+/a/#", "a/b", False),
    ],
)
def test_filter_covers(pattern: str, requested: str, covered: bool) -> None:
    assert filter_covers(pattern, requested) is covered


LEVELS = ["a", "b", "+", "#"]
filters = (
    st.lists(st.sampled_from(LEVELS), min_size=1, max_size=4)
    .filter(lambda levels: "#" not in levels[:-1])
    .map("/".join)
)


def _topics_up_to(length: int) -> list[str]:
    words = ["a", "b", "c"]  # "c" appears in no filter: a witness for what '+' admits
    return ["/".join(t) for n in range(1, length + 1) for t in itertools.product(words, repeat=n)]


TOPICS = _topics_up_to(5)


@given(filters, filters)
def test_covering_means_every_topic_of_the_request_matches_the_acl(
    pattern: str, requested: str
) -> None:
    """Sound and complete: covered exactly when no topic (words a, b and c, up to five levels:
    one more than a filter has) matches the request and not the ACL."""
    matched_by_request = [t for t in TOPICS if topics.matches(requested, t)]
    uncovered = [t for t in matched_by_request if not topics.matches(pattern, t)]
    assert filter_covers(pattern, requested) is (uncovered == [])


# ---------------------------------------------------------------------------- what accounts may do
DEVICE, OTHER = "cam-1", "cam-2"


def test_a_device_uses_its_own_topics_and_no_other_devices() -> None:
    grant = grant_of(device_account(DEVICE))
    own_sends = [
        topics.status(DEVICE), topics.reported(DEVICE), topics.events(DEVICE),
        topics.telemetry(DEVICE, TelemetryKind.HEALTH), topics.command_reply(DEVICE),
        topics.repo_request(DEVICE),
    ]  # fmt: skip
    for topic in own_sends:
        assert grant.permits(Access.PUBLISH, topic), topic
        assert not grant.permits(Access.PUBLISH, topic.replace(DEVICE, OTHER))
    assert grant.permits(Access.PUBLISH, topics.client_reply("app-a", "A" * 22))
    for topic in (topics.desired(DEVICE), topics.command(DEVICE), topics.repo_reply(DEVICE)):
        assert grant.permits(Access.SUBSCRIBE, topic) and grant.permits(Access.RECEIVE, topic)
        assert not grant.permits(Access.SUBSCRIBE, topic.replace(DEVICE, OTHER))
        assert not grant.permits(Access.RECEIVE, topic.replace(DEVICE, OTHER))
        assert not grant.permits(Access.PUBLISH, topic)  # it reads these, never writes them
    assert grant.permits(Access.SUBSCRIBE, f"mcp/v1/dev/{DEVICE}/infer/+")
    assert not grant.permits(Access.SUBSCRIBE, "mcp/v1/dev/+/desired")
    assert not grant.permits(Access.SUBSCRIBE, "#")
    assert not grant.permits(Access.PUBLISH, "mcp/v1/client/app-a/reply")  # a bare reply topic


def test_shared_subscriptions_only_where_the_role_names_them() -> None:
    device = grant_of(device_account(DEVICE))
    service = grant_of(service_account("cp-east-1"))
    app = grant_of(app_client_account("app-a"))
    fleet = "$share/agents/mcp/v1/fleet/infer/+"
    assert device.permits(Access.SUBSCRIBE, fleet)
    assert not device.permits(Access.SUBSCRIBE, "$share/other/mcp/v1/fleet/infer/+")
    assert not device.permits(Access.SUBSCRIBE, "mcp/v1/fleet/infer/+")  # only shared
    for shared in ("$share/cp/mcp/v1/dev/+/telemetry/+", "$share/repo/mcp/v1/dev/+/repo"):
        assert service.permits(Access.SUBSCRIBE, shared)
        assert not device.permits(Access.SUBSCRIBE, shared)
        assert not app.permits(Access.SUBSCRIBE, shared)
    assert service.permits(Access.SUBSCRIBE, "mcp/v1/dev/+/status")
    assert not service.permits(Access.SUBSCRIBE, "$share/cp/#")
    assert not service.permits(Access.SUBSCRIBE, "$share/+/mcp/v1/dev/+/status")  # no group
    # EMQX asks about the real filter of a shared subscription only.
    assert device.permits_shared_real_topic("mcp/v1/fleet/infer/+")
    assert not app.permits_shared_real_topic("mcp/v1/fleet/infer/+")
    assert not device.permits_shared_real_topic(f"mcp/v1/dev/{OTHER}/desired")


def test_the_service_role_sends_to_devices_and_reads_them() -> None:
    service = grant_of(service_account("cp-east-1"))
    for topic in (topics.desired(DEVICE), topics.command(DEVICE), topics.repo_reply(OTHER)):
        assert service.permits(Access.PUBLISH, topic)
    assert service.permits(Access.RECEIVE, topics.telemetry(OTHER, TelemetryKind.DRIFT))
    assert not service.permits(Access.PUBLISH, topics.telemetry(DEVICE, TelemetryKind.HEALTH))
    assert not service.permits(Access.PUBLISH, topics.fleet_infer("digits"))


def test_an_application_asks_the_fleet_and_reads_its_own_replies_only() -> None:
    app = grant_of(app_client_account("app-a"))
    assert app.permits(Access.PUBLISH, topics.fleet_infer("digits"))
    assert app.permits(Access.PUBLISH, topics.device_infer(DEVICE, "digits"))
    mine, theirs = topics.client_replies("app-a"), topics.client_replies("app-b")
    assert app.permits(Access.SUBSCRIBE, mine)
    assert app.permits(Access.RECEIVE, topics.client_reply("app-a", "B" * 22))
    assert not app.permits(Access.SUBSCRIBE, theirs)
    assert not app.permits(Access.RECEIVE, topics.client_reply("app-b", "B" * 22))
    assert not app.permits(Access.PUBLISH, topics.desired(DEVICE))


@pytest.mark.parametrize(
    "spec", [device_account(DEVICE), service_account("cp"), app_client_account("a")]
)
def test_every_acl_of_a_role_grants_its_own_topic_for_its_kind(spec: AccountSpec) -> None:
    """The grants are the dynsec role's ACLs read the same way, one by one."""
    grant = grant_of(spec)
    access = {
        AclType.PUBLISH_SEND: Access.PUBLISH,
        AclType.PUBLISH_RECEIVE: Access.RECEIVE,
        AclType.SUBSCRIBE_PATTERN: Access.SUBSCRIBE,
    }
    for acl in spec.acls:
        if acl.acl_type in access:
            concrete = acl.topic.replace("+", "x").replace("#", "y")
            wanted = acl.topic if acl.acl_type is AclType.SUBSCRIBE_PATTERN else concrete
            if acl.acl_type is AclType.SUBSCRIBE_PATTERN and wanted.startswith("$share/+/"):
                wanted = "$share/g/" + wanted.removeprefix("$share/+/")
            assert grant.permits(access[acl.acl_type], wanted), acl


@pytest.mark.parametrize(
    ("access", "topic"),
    [(Access.PUBLISH, f"mcp/v1/dev/{DEVICE}/+"), (Access.PUBLISH, ""),
     (Access.PUBLISH, "x" * 600), (Access.SUBSCRIBE, "a/#/b"), (Access.SUBSCRIBE, "$share/g"),
     (Access.SUBSCRIBE, "$share//a"), (Access.RECEIVE, "a\x00b")],
)  # fmt: skip
def test_malformed_topics_are_denied(access: Access, topic: str) -> None:
    grant = grant_of(service_account("cp"))
    assert not grant.permits(access, topic)


def test_valid_subscription() -> None:
    assert valid_subscription("$share/g/a/+") and valid_subscription("a/#")
    assert not valid_subscription("$share/+/a") and not valid_subscription("$share/g/")


# ---------------------------------------------------------------------------- settings
def _secret_file(tmp_path: Path, text: str = SECRET + "\n", mode: int = 0o600) -> Path:
    path = tmp_path / "broker-auth.secret"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_provisioner_setting_comes_from_file_environment_and_flags(tmp_path: Path) -> None:
    assert load_settings(tmp_path, environ={}).broker_provisioner is BrokerProvisionerKind.DYNSEC
    (tmp_path / "controlplane.toml").write_text('broker_provisioner = "http"\n')
    assert load_settings(tmp_path, environ={}).broker_provisioner is BrokerProvisionerKind.HTTP
    env = {"MCP_BROKER_PROVISIONER": "dynsec", "MCP_BROKER_AUTH_SECRET_FILE": "/etc/b.secret",
           "MCP_BROKER_AUTH_LISTEN": "127.0.0.1:8081"}  # fmt: skip
    loaded = load_settings(tmp_path, environ=env)
    assert loaded.broker_provisioner is BrokerProvisionerKind.DYNSEC
    assert loaded.broker_auth_secret_file == Path("/etc/b.secret")
    assert loaded.broker_auth_listen == "127.0.0.1:8081"
    flagged = load_settings(tmp_path, environ=env, overrides={"broker_provisioner": "http"})
    assert flagged.broker_provisioner is BrokerProvisionerKind.HTTP
    with pytest.raises(SettingsError, match="broker_provisioner 'emqx'"):
        load_settings(tmp_path, environ={}, overrides={"broker_provisioner": "emqx"})
    with pytest.raises(SettingsError, match="host:port"):
        load_settings(tmp_path, environ={}, overrides={"broker_auth_listen": "8081"})


def test_the_provisioner_settings_round_trip_through_the_config_file(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        broker_provisioner=BrokerProvisionerKind.HTTP,
        broker_auth_secret_file=tmp_path / "b.secret",
        broker_auth_listen="0.0.0.0:8081",
    )
    write_config_file(settings)
    assert load_settings(tmp_path, environ={}) == settings


def test_the_brokers_secret_is_read_from_a_private_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="needs broker_auth_secret_file"):
        Settings(data_dir=tmp_path).broker_auth_secret()
    good = Settings(data_dir=tmp_path, broker_auth_secret_file=_secret_file(tmp_path))
    assert good.broker_auth_secret() == SECRET
    for text, mode, problem in [
        (SECRET, 0o644, "others must have no access"),
        ("short", 0o600, "32 to 4096 characters"),
        (SECRET + "@x", 0o600, "32 to 4096 characters"),  # would break a user:secret@ URL
        (SECRET + " x", 0o600, "32 to 4096 characters"),
    ]:
        settings = Settings(
            data_dir=tmp_path, broker_auth_secret_file=_secret_file(tmp_path, text, mode)
        )
        with pytest.raises(SettingsError, match=problem):
            settings.broker_auth_secret()
    missing = Settings(data_dir=tmp_path, broker_auth_secret_file=tmp_path / "absent")
    with pytest.raises(SettingsError, match="cannot be read"):
        missing.broker_auth_secret()
