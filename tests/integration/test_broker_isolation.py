"""Per-device broker accounts against the real Mosquitto 2.0 with dynamic security.

Every account is made by `DynsecProvisioner` on a broker that denies by default, as in
production. "Never receives" is never a timing guess: each check sends the forbidden message
first and a permitted one from the same publisher last, and asserts on what arrived before the
permitted one (Mosquitto delivers one publisher's messages to a subscriber in order).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import threading
from collections.abc import AsyncIterator

import paho.mqtt.client as mqtt
import pytest

from mcp_edge.controlplane.broker.acl import (
    client_reply_filter,
    device_infer_filter,
    every_device_filter,
)
from mcp_edge.controlplane.broker.base import BrokerAdminError, Credentials
from mcp_edge.controlplane.broker.dynsec import DynsecProvisioner
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.topics import Channel, FleetInferTopic, TelemetryKind
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker, free_loopback_port
from tests.integration.conftest import MqttProbe, ProbeFactory, dynsec_request

pytestmark = pytest.mark.mosquitto

NOT_AUTHORIZED = "Not authorized"
CONTROL_TOPIC = "$CONTROL/dynamic-security/v1"


def _ids(*names: str) -> list[str]:
    """Identifiers unique to one test: the session broker keeps retained messages."""
    tag = secrets.token_hex(3)
    return [f"{name}-{tag}" for name in names]


async def _messages_until(probe: MqttProbe, marker_topic: str) -> list[mqtt.MQTTMessage]:
    """Every message `probe` receives up to and including the first on `marker_topic`."""
    received = [await probe.next_message()]
    while received[-1].topic != marker_topic:
        received.append(await probe.next_message())
    return received


@pytest.fixture
async def provisioner(dynsec_broker: DynsecMosquittoBroker) -> AsyncIterator[DynsecProvisioner]:
    broker = dynsec_broker
    async with DynsecProvisioner(
        broker.host, broker.port, broker.admin_username, broker.admin_password
    ) as provisioner:
        yield provisioner


@pytest.fixture
async def observer(
    dynsec_broker: DynsecMosquittoBroker, provisioner: DynsecProvisioner, mqtt_probe: ProbeFactory
) -> MqttProbe:
    """A control-plane service session subscribed to every device topic."""
    (name,) = _ids("svc")
    service = await mqtt_probe(dynsec_broker, await provisioner.provision_service(name))
    assert await service.subscribe(every_device_filter()) == "Granted QoS 1"
    return service


async def test_a_device_logs_in_only_with_its_own_client_id_and_password(
    dynsec_broker: DynsecMosquittoBroker, provisioner: DynsecProvisioner, mqtt_probe: ProbeFactory
) -> None:
    a_id, b_id = _ids("a", "b")
    a, b = await provisioner.provision_device(a_id), await provisioner.provision_device(b_id)

    await mqtt_probe(dynsec_broker, a, client_id=b_id, expect=NOT_AUTHORIZED)
    await mqtt_probe(dynsec_broker, a, password=b.password, expect=NOT_AUTHORIZED)
    await mqtt_probe(dynsec_broker, a, password="x" + a.password, expect=NOT_AUTHORIZED)
    await mqtt_probe(dynsec_broker, None, client_id=a_id, expect=NOT_AUTHORIZED)
    await mqtt_probe(dynsec_broker, a)
    await mqtt_probe(dynsec_broker, b)


async def test_a_device_cannot_subscribe_to_other_devices_or_broad_filters(
    dynsec_broker: DynsecMosquittoBroker,
    provisioner: DynsecProvisioner,
    mqtt_probe: ProbeFactory,
    observer: MqttProbe,
) -> None:
    a_id, b_id = _ids("a", "b")
    a = await mqtt_probe(dynsec_broker, await provisioner.provision_device(a_id))
    b = await mqtt_probe(dynsec_broker, await provisioner.provision_device(b_id))
    forbidden = [
        topics.desired(b_id),
        topics.command(b_id),
        topics.telemetry(b_id, TelemetryKind.HEALTH),
        topics.reported(b_id),
        topics.device_infer(b_id, "digits"),
        topics.repo_reply(b_id),
        topics.device_subtree(b_id),
        topics.all_devices(Channel.DESIRED),
        topics.all_devices(Channel.TELEMETRY),
        topics.shared_subscription("agents", topics.all_devices(Channel.TELEMETRY)),
        topics.fleet_infer("digits"),  # fleet requests only through the share group
        FleetInferTopic("digits").shared("other-group"),
        str(topics.ClientReplyTopic.new("some-app")),  # devices answer applications, never read
        topics.client_replies("some-app"),
        client_reply_filter(),
        "mcp/#",
        "#",
        "$CONTROL/#",
        CONTROL_TOPIC + "/response",
        "$SYS/#",
    ]
    for topic_filter in forbidden:
        assert await a.subscribe(topic_filter) == NOT_AUTHORIZED, topic_filter
    assert await a.subscribe(topics.desired(a_id)) == "Granted QoS 1"

    # Whatever a refused subscription might still let through would arrive before the
    # message on A's own desired topic, which the service publishes last.
    service = observer
    for topic in (topics.desired(b_id), topics.command(b_id), topics.repo_reply(b_id)):
        assert not (await service.publish(topic, b"for b")).is_failure
    assert not (await b.publish(topics.telemetry(b_id, "health"), b"b health")).is_failure
    assert not (await service.publish(topics.desired(a_id), b"for a")).is_failure

    (only,) = await _messages_until(a, topics.desired(a_id))
    assert only.payload == b"for a"


async def test_a_device_cannot_publish_on_other_devices_topics_nor_forge_its_commands(
    dynsec_broker: DynsecMosquittoBroker,
    provisioner: DynsecProvisioner,
    mqtt_probe: ProbeFactory,
    observer: MqttProbe,
) -> None:
    a_id, b_id = _ids("a", "b")
    a = await mqtt_probe(dynsec_broker, await provisioner.provision_device(a_id))
    forbidden = [
        topics.status(b_id),
        topics.reported(b_id),
        topics.events(b_id),
        topics.telemetry(b_id, "health"),
        topics.command_reply(b_id),
        topics.repo_request(b_id),
        topics.desired(b_id),
        topics.command(b_id),
        topics.device_infer(b_id, "digits"),
        topics.desired(a_id),  # a device never writes its own desired state or commands
        topics.command(a_id),
        topics.repo_reply(a_id),
        topics.fleet_infer("digits"),
    ]
    for topic in forbidden:
        assert await a.publish(topic, b"forged") == NOT_AUTHORIZED, topic
    own = topics.telemetry(a_id, TelemetryKind.HEALTH)
    assert not (await a.publish(own, b"genuine")).is_failure

    (only,) = await _messages_until(observer, own)
    assert only.payload == b"genuine"


async def test_a_device_cannot_administer_the_broker(
    dynsec_broker: DynsecMosquittoBroker, provisioner: DynsecProvisioner, mqtt_probe: ProbeFactory
) -> None:
    a_id, b_id, evil = _ids("a", "b", "evil")
    a = await mqtt_probe(dynsec_broker, await provisioner.provision_device(a_id))
    b_credentials = await provisioner.provision_device(b_id)
    b = await mqtt_probe(dynsec_broker, b_credentials)
    commands = [
        {"command": "createClient", "username": evil, "password": "pw"},
        {"command": "disableClient", "username": b_credentials.username},
    ]

    payload = json.dumps({"commands": commands}).encode()
    assert await a.publish(CONTROL_TOPIC, payload) == NOT_AUTHORIZED

    evil_credentials = Credentials(username=evil, password="pw", client_id=evil)
    await mqtt_probe(dynsec_broker, evil_credentials, expect=NOT_AUTHORIZED)
    assert not b.disconnected.done()
    await mqtt_probe(dynsec_broker, b_credentials)  # B's account is still enabled


async def test_a_revoked_device_is_disconnected_and_refused_until_enabled(
    dynsec_broker: DynsecMosquittoBroker, provisioner: DynsecProvisioner, mqtt_probe: ProbeFactory
) -> None:
    (a_id,) = _ids("a")
    credentials = await provisioner.provision_device(a_id)
    live = await mqtt_probe(dynsec_broker, credentials)

    await provisioner.disable_device(a_id)
    await provisioner.disable_device(a_id)  # idempotent

    assert await live.disconnect_reason() == "Administrative action"
    await mqtt_probe(dynsec_broker, credentials, expect=NOT_AUTHORIZED)
    await provisioner.enable_device(a_id)
    await mqtt_probe(dynsec_broker, credentials)


async def test_a_deleted_device_is_disconnected_and_its_account_gone(
    dynsec_broker: DynsecMosquittoBroker, provisioner: DynsecProvisioner, mqtt_probe: ProbeFactory
) -> None:
    (a_id,) = _ids("a")
    credentials = await provisioner.provision_device(a_id)
    live = await mqtt_probe(dynsec_broker, credentials)

    await provisioner.delete_device(a_id)
    await provisioner.delete_device(a_id)  # idempotent

    assert (await live.disconnect_reason()).is_failure
    await mqtt_probe(dynsec_broker, credentials, expect=NOT_AUTHORIZED)
    with pytest.raises(BrokerAdminError, match="Client not found"):
        await provisioner.enable_device(a_id)


async def test_provisioning_again_resets_the_password(
    dynsec_broker: DynsecMosquittoBroker, provisioner: DynsecProvisioner, mqtt_probe: ProbeFactory
) -> None:
    (a_id,) = _ids("a")
    first = await provisioner.provision_device(a_id)
    second = await provisioner.provision_device(a_id)

    assert first.password != second.password and len(second.password) >= 43
    await mqtt_probe(dynsec_broker, first, expect=NOT_AUTHORIZED)
    device = await mqtt_probe(dynsec_broker, second)
    assert await device.subscribe(topics.command(a_id)) == "Granted QoS 1"


async def test_one_client_id_belongs_to_one_account(
    dynsec_broker: DynsecMosquittoBroker, provisioner: DynsecProvisioner, mqtt_probe: ProbeFactory
) -> None:
    (shared_id,) = _ids("x")
    device = await mqtt_probe(dynsec_broker, await provisioner.provision_device(shared_id))

    with pytest.raises(BrokerAdminError, match="already belongs to account 'dev-"):
        await provisioner.provision_app_client(shared_id)
    with pytest.raises(BrokerAdminError, match="already belongs"):
        await provisioner.provision_service(shared_id)
    assert not device.disconnected.done()


async def test_fleet_requests_reach_exactly_one_device_and_replies_reach_the_app(
    dynsec_broker: DynsecMosquittoBroker, provisioner: DynsecProvisioner, mqtt_probe: ProbeFactory
) -> None:
    a_id, b_id, app_id = _ids("a", "b", "app")
    devices = {
        device_id: await mqtt_probe(dynsec_broker, await provisioner.provision_device(device_id))
        for device_id in (a_id, b_id)
    }
    app = await mqtt_probe(dynsec_broker, await provisioner.provision_app_client(app_id))
    reply = str(topics.ClientReplyTopic.new(app_id))
    assert await app.subscribe(reply) == "Granted QoS 1"
    for device_id, device in devices.items():
        assert await device.subscribe(FleetInferTopic("digits").shared()) == "Granted QoS 1"
        assert await device.subscribe(device_infer_filter(device_id)) == "Granted QoS 1"

    requests = [f"request-{i}".encode() for i in range(20)]
    for request in requests:
        assert not (await app.publish(topics.fleet_infer("digits"), request)).is_failure
    for device_id in devices:  # a last message to each device bounds what it got
        assert not (await app.publish(topics.device_infer(device_id, "digits"), b"end")).is_failure

    served = {}
    for device_id, device in devices.items():
        *fleet, _end = await _messages_until(device, topics.device_infer(device_id, "digits"))
        served[device_id] = [message.payload for message in fleet]
    assert sorted(served[a_id] + served[b_id]) == sorted(requests)  # each exactly once
    assert served[a_id] and served[b_id]  # and spread over both

    assert not (await devices[a_id].publish(reply, b"answer")).is_failure
    assert (await app.next_message()).payload == b"answer"
    for device in devices.values():  # the unsubscribe ACL names the $share form too
        assert await device.unsubscribe(FleetInferTopic("digits").shared()) == "Success"


async def test_an_app_client_reads_only_its_own_replies(
    dynsec_broker: DynsecMosquittoBroker, provisioner: DynsecProvisioner, mqtt_probe: ProbeFactory
) -> None:
    a_id, app_id, other_id = _ids("a", "app", "other")
    device = await mqtt_probe(dynsec_broker, await provisioner.provision_device(a_id))
    app = await mqtt_probe(dynsec_broker, await provisioner.provision_app_client(app_id))
    await provisioner.provision_app_client(other_id)

    sessions = {cid: topics.ClientReplyTopic.new(cid) for cid in (other_id, app_id)}
    for topic_filter in (
        str(sessions[other_id]),
        topics.client_replies(other_id),
        client_reply_filter(),
        f"mcp/v1/client/{app_id}/reply",  # the bare topic is no reply topic any more
        topics.device_subtree(a_id),
        topics.fleet_infer("digits"),
        "#",
    ):
        assert await app.subscribe(topic_filter) == NOT_AUTHORIZED, topic_filter
    assert await app.subscribe(topics.client_replies(app_id)) == "Granted QoS 1"
    assert await app.publish(topics.desired(a_id), b"forged") == NOT_AUTHORIZED
    assert await app.publish(str(sessions[app_id]), b"forged") == NOT_AUTHORIZED
    assert not (await app.publish(topics.device_infer(a_id, "digits"), b"req")).is_failure

    for client_id, session in sessions.items():
        assert not (await device.publish(str(session), f"for {client_id}".encode())).is_failure
    (only,) = await _messages_until(app, str(sessions[app_id]))
    assert only.payload == f"for {app_id}".encode()


async def test_a_device_reaches_an_app_only_on_the_reply_topic_its_request_named(
    dynsec_broker: DynsecMosquittoBroker, provisioner: DynsecProvisioner, mqtt_probe: ProbeFactory
) -> None:
    a_id, app_id, other_id = _ids("a", "app", "other")
    device = await mqtt_probe(dynsec_broker, await provisioner.provision_device(a_id))
    apps = {
        cid: await mqtt_probe(dynsec_broker, await provisioner.provision_app_client(cid))
        for cid in (app_id, other_id)
    }
    # What an InferenceClient does: subscribe to its own session's reply topic and nothing else.
    sessions = {client_id: topics.ClientReplyTopic.new(client_id) for client_id in apps}
    for client_id, app in apps.items():
        assert await app.subscribe(str(sessions[client_id])) == "Granted QoS 1"

    for client_id in apps:
        bare = f"mcp/v1/client/{client_id}/reply"
        assert await device.publish(bare, b"flood") == NOT_AUTHORIZED, bare
        deeper = f"{sessions[client_id]}/deeper"
        assert await device.publish(deeper, b"flood") == NOT_AUTHORIZED, deeper
        # A token the device was never sent: the broker takes the message, nobody receives it.
        guessed = str(topics.ClientReplyTopic.new(client_id))
        assert not (await device.publish(guessed, b"guessed")).is_failure
    for client_id in apps:
        topic = str(sessions[client_id])
        assert not (await device.publish(topic, f"for {client_id}".encode())).is_failure

    for client_id, app in apps.items():
        (only,) = await _messages_until(app, str(sessions[client_id]))
        assert only.payload == f"for {client_id}".encode()


async def test_the_service_reads_every_device_and_writes_desired_state(
    dynsec_broker: DynsecMosquittoBroker, provisioner: DynsecProvisioner, mqtt_probe: ProbeFactory
) -> None:
    a_id, b_id, svc_id = _ids("a", "b", "svc")
    devices = {
        device_id: await mqtt_probe(dynsec_broker, await provisioner.provision_device(device_id))
        for device_id in (a_id, b_id)
    }
    service = await mqtt_probe(dynsec_broker, await provisioner.provision_service(svc_id))
    telemetry_filter = topics.all_devices(Channel.TELEMETRY)
    assert await service.subscribe(topics.shared_subscription("cp", telemetry_filter)) == (
        "Granted QoS 1"
    )
    for topic_filter in ("#", "$CONTROL/#", topics.fleet_infer("digits"), "mcp/#"):
        assert await service.subscribe(topic_filter) == NOT_AUTHORIZED, topic_filter

    for device_id, device in devices.items():
        topic = topics.telemetry(device_id, TelemetryKind.HEALTH)
        assert not (await device.publish(topic, device_id.encode())).is_failure
    received = {(await service.next_message()).payload for _ in devices}
    assert received == {a_id.encode(), b_id.encode()}

    desired = topics.desired(a_id)
    assert not (await service.publish(desired, b"signed state", retain=True)).is_failure
    assert await devices[a_id].subscribe(desired) == "Granted QoS 1"
    retained = await devices[a_id].next_message()
    assert (retained.topic, retained.payload, retained.retain) == (desired, b"signed state", True)
    assert await service.publish(topics.fleet_infer("digits"), b"x") == NOT_AUTHORIZED


async def test_the_provisioner_refuses_bad_admin_logins_and_unreachable_brokers(
    dynsec_broker: DynsecMosquittoBroker,
) -> None:
    broker = dynsec_broker
    (plain,) = _ids("plain")
    dynsec_request(
        broker.host,
        broker.port,
        broker.admin_username,
        broker.admin_password,
        [{"command": "createClient", "username": plain, "password": "pw"}],
    )

    with pytest.raises(BrokerAdminError, match="refused the admin login"):
        async with DynsecProvisioner(broker.host, broker.port, broker.admin_username, "wrong"):
            pass
    with pytest.raises(BrokerAdminError, match="not an admin"):
        async with DynsecProvisioner(broker.host, broker.port, plain, "pw"):
            pass
    with pytest.raises(BrokerAdminError, match="cannot connect"):
        async with DynsecProvisioner(broker.host, free_loopback_port(), "admin", "pw"):
            pass
    async with DynsecProvisioner(
        broker.host, broker.port, broker.admin_username, broker.admin_password
    ) as provisioner:
        assert provisioner.connected and provisioner.tcp_nodelay
        # The admin session runs on the event loop like every MQTT session: no paho thread.
        assert [t.name for t in threading.enumerate() if t.name.startswith("paho")] == []


async def test_the_provisioner_times_out_fails_on_a_lost_broker_and_recovers(
    fresh_dynsec_broker: DynsecMosquittoBroker, mqtt_probe: ProbeFactory
) -> None:
    broker = fresh_dynsec_broker
    admin = (broker.host, broker.port, broker.admin_username, broker.admin_password)
    async with (
        DynsecProvisioner(*admin, timeout_s=0.5) as quick,
        DynsecProvisioner(*admin, timeout_s=60) as patient,
    ):
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            with pytest.raises(BrokerAdminError, match="did not answer"):
                await quick.provision_device("frozen")
            sent = patient.messages_sent
            pending = asyncio.create_task(patient.provision_device("lost"))

            async def request_sent() -> None:
                while patient.messages_sent == sent:
                    await asyncio.sleep(0.005)

            # The batcher sends after its window: the broker must die with the request out.
            await asyncio.wait_for(request_sent(), timeout=10)
            broker.kill()
        finally:
            if broker.running:
                os.kill(broker.pid, signal.SIGCONT)
        with pytest.raises(BrokerAdminError, match="lost"):
            await pending
        with pytest.raises(BrokerAdminError, match="not connected"):
            await patient.disable_device("lost")

        broker.start()
        await patient.wait_connected(timeout_s=30)
        credentials = await patient.provision_device("back")
        await mqtt_probe(broker, credentials)
