"""Hard examples on the control plane: the checks every device batch passes, the command
client's reply handling, storage with dedupe, and the dataset export (docs/hard-examples.md).

The service and export tests run on a real SQLite database migrated to head; devices answer
through a fake of our own command interface (:class:`FakeCommands`), the broker path is in
tests/integration/test_hard_examples.py.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from mcp_edge.controlplane.broker.acl import AclType, service_acls
from mcp_edge.controlplane.commands import (
    CommandReplyError,
    CommandTimeoutError,
    CommandUnavailableError,
    DeviceCommands,
)
from mcp_edge.controlplane.db import Database, upgrade_head
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import hard_examples as q
from mcp_edge.controlplane.db.models import RetrainingTriggerRow
from mcp_edge.controlplane.hard_example_checks import (
    BatchRefusedError,
    budget,
    check_batch,
)
from mcp_edge.controlplane.hard_example_dataset import metadata, write_npz
from mcp_edge.controlplane.hard_examples import HardExampleService
from mcp_edge.shared.mqtt import InboundMessage
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.command import CommandName, CommandReply, ErrorReply
from mcp_edge.shared.protocol.state import MAX_HARD_EXAMPLE_BUDGET

NOW = datetime(2026, 12, 15, 12, 0, tzinfo=timezone.utc)
MODEL, VERSION = "digits", "1.0.0"
Json = dict[str, Any]


def tensor(name: str, array: npt.NDArray[Any], datatype: str | None = None) -> Json:
    datatype = datatype or {"float32": "FP32", "uint8": "UINT8", "int64": "INT64"}[str(array.dtype)]
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return {
        "name": name,
        "datatype": datatype,
        "shape": list(array.shape),
        "data_b64": base64.b64encode(data).decode(),
    }


def example(
    row: npt.NDArray[Any], *, output: npt.NDArray[Any] | None = None, **fields: Any
) -> Json:
    out = {
        "model": MODEL,
        "version": VERSION,
        "ts": 1_765_800_000.5,
        "confidence": 0.31,
        "predicted": 3,
        "input": tensor("input", row),
    }
    if output is not None:
        out["output"] = tensor("probabilities", output)
    out.update(fields)
    return out


def nbytes(examples: list[Json]) -> int:
    total = 0
    for ex in examples:
        for key in ("input", "output"):
            if ex.get(key):
                total += len(base64.b64decode(ex[key]["data_b64"]))
    return total


def batch(examples: list[Json], *, held: int = 0, bytes_: int | None = None) -> Json:
    return {
        "examples": examples,
        "bytes": nbytes(examples) if bytes_ is None else bytes_,
        "held": held,
    }


def rows(n: int, seed: int = 0) -> list[npt.NDArray[np.float32]]:
    rng = np.random.default_rng(seed)
    return [rng.random((1, 64), dtype=np.float32) for _ in range(n)]


# ---------------------------------------------------------------------------- the checks
def test_a_good_batch_keeps_every_byte_and_hashes_the_input() -> None:
    inputs = rows(3)
    outputs = [np.full((1, 10), 0.1, np.float32) for _ in inputs]
    result = batch([example(x, output=o) for x, o in zip(inputs, outputs, strict=True)], held=7)
    checked = check_batch(result, model=MODEL, version=VERSION, max_bytes=10_000)
    assert checked.held == 7 and checked.repeated == 0
    assert [e.input.data for e in checked.examples] == [x.tobytes() for x in inputs]
    assert [e.sha256 for e in checked.examples] == [
        hashlib.sha256(x.tobytes()).hexdigest() for x in inputs
    ]
    assert checked.examples[0].output is not None
    assert checked.examples[0].output.data == outputs[0].tobytes()
    assert checked.examples[0].input.shape == [1, 64]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda ex: ex["input"].update(shape=[1, 65]), "shape"),  # bytes of 64, shape of 65
        (lambda ex: ex["input"].update(datatype="FP64"), "shape"),  # FP32 bytes called FP64
        (lambda ex: ex["input"].update(datatype="UINT8"), "shape"),
        (lambda ex: ex["input"].update(data_b64="not base64!"), "base64"),
        (lambda ex: ex.update(model="other"), "model"),
        (lambda ex: ex.update(version="2.0.0"), "version"),
        (lambda ex: ex.update(confidence=1.5), "schema"),
        (lambda ex: ex["input"].update(datatype="FP8"), "schema"),
    ],
)
def test_one_bad_example_refuses_the_whole_batch(
    change: Callable[[Json], None], reason: str
) -> None:
    examples = [example(x) for x in rows(3)]
    change(examples[2])
    result = batch(examples, bytes_=3 * 256)
    with pytest.raises(BatchRefusedError) as refused:
        check_batch(result, model=MODEL, version=VERSION, max_bytes=10_000)
    assert refused.value.reason == reason


def test_a_batch_over_the_budget_is_refused() -> None:
    examples = [example(x) for x in rows(4)]  # 4 x 256 bytes
    assert (
        len(check_batch(batch(examples), model=MODEL, version=VERSION, max_bytes=1024).examples)
        == 4
    )
    with pytest.raises(BatchRefusedError) as refused:
        check_batch(batch(examples), model=MODEL, version=VERSION, max_bytes=1023)
    assert refused.value.reason == "over_budget"


def test_the_reply_must_say_the_bytes_it_holds() -> None:
    examples = [example(x) for x in rows(2)]
    with pytest.raises(BatchRefusedError) as refused:
        check_batch(batch(examples, bytes_=100), model=MODEL, version=VERSION, max_bytes=10_000)
    assert refused.value.reason == "bytes"


def test_any_version_is_taken_when_none_was_asked_and_repeats_are_kept_once() -> None:
    x = rows(1)[0]
    result = batch([example(x), example(x, version="1.1.0"), example(x)])
    checked = check_batch(result, model=MODEL, version=None, max_bytes=10_000)
    assert len(checked.examples) == 1 and checked.repeated == 2


def test_the_budget_is_capped_at_the_protocol_ceiling() -> None:
    assert budget(None) == MAX_HARD_EXAMPLE_BUDGET
    assert budget(10**9) == MAX_HARD_EXAMPLE_BUDGET
    assert budget(1000) == 1000
    with pytest.raises(ValueError):
        budget(-1)


def test_the_control_plane_role_may_send_commands_and_read_replies() -> None:
    acls = service_acls()
    device = "cam-1"

    def allowed(kind: AclType, topic: str) -> bool:
        return any(a.acl_type is kind and topics.matches(a.topic, topic) for a in acls)

    assert allowed(AclType.PUBLISH_SEND, topics.command(device))
    assert allowed(AclType.PUBLISH_RECEIVE, topics.command_reply(device))
    # Subscribing to the filter: the broker matches it against a pattern ACL level by level.
    (reply_filter,) = DeviceCommands.filters()
    assert reply_filter == "mcp/v1/dev/+/cmd/reply"

    def covers(pattern: str, wanted: str) -> bool:
        p, w = pattern.split("/"), wanted.split("/")
        for i, level in enumerate(p):
            if level == "#":
                return True
            if i >= len(w) or (level != "+" and level != w[i]):
                return False
        return len(p) == len(w)

    assert any(
        a.acl_type is AclType.SUBSCRIBE_PATTERN and covers(a.topic, reply_filter) for a in acls
    )


# ---------------------------------------------------------------------------- the client
class FakePublisher:
    """Our CommandPublisher: records what is sent; ``answer`` replies from the test."""

    def __init__(self) -> None:
        self.up = True
        self.problem: str | None = None
        self.sent: list[InboundMessage] = []
        self.published = asyncio.Event()

    async def publish(self, topic: str, payload: bytes, **props: Any) -> None:
        self.sent.append(
            InboundMessage(
                topic,
                payload,
                response_topic=props.get("response_topic"),
                correlation_data=props.get("correlation_data"),
            )
        )
        self.published.set()


def reply_to(request: InboundMessage, device_id: str, **fields: Any) -> InboundMessage:
    body = json.loads(request.payload)
    reply = {"command_id": body["command_id"], "ok": True, "result": {}} | fields
    return InboundMessage(
        topics.command_reply(device_id),
        json.dumps(reply).encode(),
        correlation_data=request.correlation_data,
    )


async def _sent(publisher: FakePublisher) -> InboundMessage:
    await asyncio.wait_for(publisher.published.wait(), 5)
    return publisher.sent[-1]


async def test_the_reply_of_the_asked_device_comes_back_and_another_device_is_ignored() -> None:
    commands, publisher = DeviceCommands(), FakePublisher()
    commands.use_session(publisher)
    task = asyncio.create_task(commands.send("cam-1", CommandName.PING, {}, timeout_s=5))
    request = await _sent(publisher)
    assert request.topic == topics.command("cam-1")
    assert request.response_topic == topics.command_reply("cam-1")
    body = json.loads(request.payload)
    assert body["name"] == "ping" and request.correlation_data == bytes.fromhex(body["command_id"])
    commands.on_message(reply_to(request, "cam-2", result={"from": "cam-2"}))
    commands.on_message(reply_to(request, "cam-1", result={"from": "cam-1"}))
    reply = await task
    assert reply.ok and reply.result == {"from": "cam-1"}
    assert commands.metrics.dropped.labels("wrong_device")._value.get() == 1
    assert commands.in_flight == 0


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"x" * (CommandReply.MAX_BYTES + 1), "too_large"),
        (b"{not json", "json"),
        (b'{"ok": true}', "schema"),
        (json.dumps({"command_id": "0" * 32, "ok": True}).encode(), "command_id"),
    ],
)
async def test_an_unusable_reply_of_the_asked_device_fails_the_command(
    payload: bytes, reason: str
) -> None:
    commands, publisher = DeviceCommands(), FakePublisher()
    commands.use_session(publisher)
    task = asyncio.create_task(commands.send("cam-1", CommandName.PING, timeout_s=5))
    request = await _sent(publisher)
    commands.on_message(
        InboundMessage(
            topics.command_reply("cam-1"), payload, correlation_data=request.correlation_data
        )
    )
    with pytest.raises(CommandReplyError) as failed:
        await task
    assert failed.value.reason == reason


async def test_no_reply_times_out_and_a_late_one_is_dropped() -> None:
    commands, publisher = DeviceCommands(), FakePublisher()
    commands.use_session(publisher)
    with pytest.raises(CommandTimeoutError, match=r"did not answer ping within 0\.05 s"):
        await commands.send("cam-1", CommandName.PING, timeout_s=0.05)
    commands.on_message(reply_to(publisher.sent[-1], "cam-1"))
    assert commands.metrics.dropped.labels("unknown")._value.get() == 1
    assert commands.metrics.sent.labels("ping", "timeout")._value.get() == 1


async def test_nothing_is_sent_without_a_session_that_is_up() -> None:
    commands, publisher = DeviceCommands(), FakePublisher()
    with pytest.raises(CommandUnavailableError, match="no broker session"):
        await commands.send("cam-1", CommandName.PING)
    commands.use_session(publisher)
    publisher.up, publisher.problem = False, "broker unreachable"
    with pytest.raises(CommandUnavailableError, match="broker unreachable"):
        await commands.send("cam-1", CommandName.PING)
    assert publisher.sent == []


# ---------------------------------------------------------------------------- storage and export
class FakeCommands(DeviceCommands):
    """Devices answering from a table: ``answers[device]`` is the reply's result, an
    ErrorReply, or an exception to raise."""

    def __init__(self, answers: dict[str, Any]) -> None:
        super().__init__()
        self.answers = answers
        self.asked: list[tuple[str, dict[str, Any]]] = []

    async def send(
        self,
        device_id: str,
        name: CommandName,
        args: Any = None,
        timeout_s: float = 10.0,
    ) -> CommandReply:
        self.asked.append((device_id, dict(args or {})))
        answer = self.answers[device_id]
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, ErrorReply):
            return CommandReply(command_id="0" * 32, ok=False, error=answer)
        return CommandReply(command_id="0" * 32, ok=True, result=answer)


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(f"sqlite:///{tmp_path / 'cp.db'}")
    await upgrade_head(database)
    async with database.transaction() as tx:
        for i, device_id in enumerate(("cam-1", "cam-2", "cam-3", "cam-off")):
            await device_q.insert_device(
                tx, device_id=device_id, public_key=f"{i:064x}", status="accepted", now=NOW
            )
            if device_id != "cam-off":
                await device_q.update_device(tx, device_id, now=NOW, online=True)
        tx.add(
            RetrainingTriggerRow(
                id=1, model=MODEL, version=VERSION, raised_at=NOW, status="open", score=0.4,
                figures={}, rule={"collect_hard_examples": True}, device_count=4,
                device_ids=["cam-1", "cam-2", "cam-3", "cam-off", "cam-gone"], note="",
            )
        )  # fmt: skip
    yield database
    await database.dispose()


async def test_collect_stores_good_batches_refuses_bad_ones_and_dedupes(db: Database) -> None:
    good = rows(3, seed=1)
    outputs = [np.arange(10, dtype=np.float32).reshape(1, 10) for _ in good]
    answers: dict[str, Any] = {
        "cam-1": batch([example(x, output=o) for x, o in zip(good, outputs, strict=True)]),
        "cam-2": batch([example(x) for x in rows(4, seed=2)]),  # 1024 bytes: over 1000
        "cam-3": ErrorReply(error="hard examples are off in this device's policy"),
    }
    fake = FakeCommands(answers)
    service = HardExampleService(db, fake, lambda: NOW)
    result = await service.collect_trigger(1, max_bytes=1000)
    by_device = {d.device_id: d for d in result.devices}
    assert {d: o.status for d, o in by_device.items()} == {
        "cam-1": "stored", "cam-2": "refused", "cam-3": "failed", "cam-off": "offline",
        "cam-gone": "unknown",
    }  # fmt: skip
    assert by_device["cam-1"].stored == 3 and by_device["cam-1"].bytes == 3 * (256 + 40)
    assert "over_budget" in by_device["cam-2"].detail
    assert "policy" in by_device["cam-3"].detail
    assert sorted(d for d, _ in fake.asked) == ["cam-1", "cam-2", "cam-3"]
    assert fake.asked[0][1] == {"model": MODEL, "version": VERSION, "max_bytes": 1000}
    assert service.metrics.refused.labels("over_budget")._value.get() == 1

    async with db.read() as tx:
        stored = await q.list_examples(tx, 1)
    assert [e.device_id for e in stored] == ["cam-1"] * 3
    assert [e.sha256 for e in stored] == [hashlib.sha256(x.tobytes()).hexdigest() for x in good]

    # The same inputs again (and one new): only the new one is stored.
    fresh = rows(1, seed=9)[0]
    answers["cam-1"] = batch([example(x) for x in [*good, fresh]])
    again = await service.collect_trigger(1, device_ids=["cam-1"], max_bytes=1024)
    assert (again.stored, again.duplicates) == (1, 3)
    async with db.read() as tx:
        assert await q.count_examples(tx, 1) == 4


async def test_the_export_is_byte_identical_stacked_or_per_example(db: Database) -> None:
    inputs = rows(3, seed=4)
    images = [np.arange(12, dtype=np.uint8).reshape(1, 3, 4) + i for i in range(2)]
    outputs = [np.full((1, 10), i / 10, np.float32) for i in range(3)]
    fake = FakeCommands({
        "cam-1": batch([example(x, output=o) for x, o in zip(inputs, outputs, strict=True)]),
        "cam-2": batch([example(img, predicted=None) for img in images]),
    })  # fmt: skip
    service = HardExampleService(db, fake, lambda: NOW)
    await service.collect_trigger(1, device_ids=["cam-1"])
    async with db.read() as tx:
        trigger = await q.get_trigger(tx, 1)
        page = await q.list_examples(tx, 1)
    assert trigger is not None
    out = io.BytesIO()
    await write_npz(db, page, out)
    with np.load(io.BytesIO(out.getvalue()), allow_pickle=False) as npz:
        assert npz["inputs"].shape == (3, 1, 64) and npz["inputs"].dtype == np.dtype("<f4")
        assert [r.tobytes() for r in npz["inputs"]] == [x.tobytes() for x in inputs]
        assert [r.tobytes() for r in npz["outputs"]] == [o.tobytes() for o in outputs]
        assert npz["device_ids"].tolist() == ["cam-1"] * 3
        assert npz["predicted"].tolist() == [3, 3, 3]
        assert npz["times"].tolist() == [1_765_800_000.5] * 3
        assert npz["confidences"].dtype == np.float64

    # Shapes that disagree: one array per example, and no outputs where none were sent.
    await service.collect_trigger(1, device_ids=["cam-2"])
    async with db.read() as tx:
        page = await q.list_examples(tx, 1)
    meta = metadata(trigger, page, total=len(page), next_after_id=None)
    assert meta["layout"] == {"inputs": "per_example", "outputs": "per_example"}
    out = io.BytesIO()
    await write_npz(db, page, out)
    with np.load(io.BytesIO(out.getvalue()), allow_pickle=False) as npz:
        assert "inputs" not in npz.files
        sent: list[npt.NDArray[Any]] = [*inputs, *images]
        assert [npz[f"input_{i}"].tobytes() for i in range(5)] == [x.tobytes() for x in sent]
        assert npz["input_4"].dtype == np.uint8 and npz["input_4"].shape == (1, 3, 4)
        assert sorted(f for f in npz.files if f.startswith("output_")) == [
            "output_0", "output_1", "output_2",
        ]  # fmt: skip
        assert npz["predicted"].tolist() == [3, 3, 3, -1, -1]
        assert npz["sha256"].tolist() == [e["sha256"] for e in meta["examples"]]
    assert [e["input"]["shape"] for e in meta["examples"]][3:] == [[1, 3, 4], [1, 3, 4]]
    assert meta["bytes"] == 3 * (256 + 40) + 2 * 12


async def test_a_trigger_whose_rule_asks_collects_in_the_background(db: Database) -> None:
    x = rows(1)[0]
    fake = FakeCommands({d: batch([example(x)]) for d in ("cam-1", "cam-2", "cam-3")})
    service = HardExampleService(db, fake, lambda: NOW)
    await service.on_trigger(1)
    await service.wait_idle()
    async with db.read() as tx:
        assert await q.count_examples(tx, 1) == 3  # one per device: dedupe is per device
    assert fake.asked and all(
        args["max_bytes"] == MAX_HARD_EXAMPLE_BUDGET for _, args in fake.asked
    )
