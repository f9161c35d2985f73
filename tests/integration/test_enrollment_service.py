"""The enrollment service on its own, without HTTP: a real SQLite database, the fake broker
provisioner, and a stand-in for the deployments that fails the way a lost database would.

What the REST tests cannot reach: a device whose acceptance committed stays accepted (and can
fetch its credentials) when giving it its standing deployments fails afterwards.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mcp_edge.controlplane.auth import ENROLLMENT_TOKEN_PREFIX, issue_secret
from mcp_edge.controlplane.bootstrap import initialize
from mcp_edge.controlplane.db import Database, UnavailableError
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import enrollment as token_q
from mcp_edge.controlplane.enrollment import Approval
from mcp_edge.controlplane.enrollment_service import EnrollmentService
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.settings import PasswordCost, Settings
from mcp_edge.shared.protocol.enrollment import EnrollmentStatus, TrustRoot
from mcp_edge.shared.signing import PrivateKey
from tests.support.controlplane import ADMIN_PASSWORD, FakeClock, FakeProvisioner, envelope


class NoTrust:
    async def trust_root(self) -> TrustRoot:
        return TrustRoot()


@dataclass
class LostDeployments:
    """Gives no device its deployments: the database is gone by the time it is asked."""

    asked: list[str] = field(default_factory=list)

    async def device_accepted(self, device_id: str) -> object:
        self.asked.append(device_id)
        raise UnavailableError("database connection lost (fake)")


@dataclass
class Enrollment:
    service: EnrollmentService
    db: Database
    clock: FakeClock
    deployments: LostDeployments
    provisioner: FakeProvisioner

    async def token(self, approval: Approval) -> str:
        secret = issue_secret(ENROLLMENT_TOKEN_PREFIX)
        async with self.db.transaction() as tx:
            await token_q.create_token(
                tx,
                token_hash=secret.digest,
                prefix=secret.prefix,
                now=self.clock(),
                created_by="admin",
                approval=approval.value,
            )
        return secret.token

    async def status(self, device_id: str) -> str | None:
        async with self.db.read() as tx:
            view = await device_q.get_device(tx, device_id)
        return view.status if view else None


@pytest.fixture
async def enrollment(tmp_path: Path) -> AsyncIterator[Enrollment]:
    settings = Settings(
        data_dir=tmp_path / "cp",
        database_url=f"sqlite:///{tmp_path / 'cp.db'}",
        password_cost=PasswordCost.MIN,
        broker_urls=("mqtt://broker.test:1883",),
    )
    clock = FakeClock()
    await initialize(settings, clock=clock, admin_user="admin", admin_password=ADMIN_PASSWORD)
    db = Database(settings.effective_database_url)
    deployments, provisioner = LostDeployments(), FakeProvisioner()
    service = EnrollmentService(
        db, provisioner, NoTrust(), settings, clock, ControlPlaneMetrics(), deployments=deployments
    )
    yield Enrollment(service, db, clock, deployments, provisioner)
    await db.dispose()


async def test_an_enrolled_device_keeps_its_credentials_when_its_deployments_fail(
    enrollment: Enrollment,
) -> None:
    token = await enrollment.token(Approval.AUTO)
    answer = await enrollment.service.enroll(
        envelope(PrivateKey.generate(), token, now=enrollment.clock(), device_id="cam-1")
    )
    assert answer.status is EnrollmentStatus.ACCEPTED
    assert answer.broker is not None and answer.broker.username == "cam-1"
    assert enrollment.deployments.asked == ["cam-1"]
    assert await enrollment.status("cam-1") == "accepted"


async def test_an_approval_stands_when_the_deployments_fail(enrollment: Enrollment) -> None:
    key = PrivateKey.generate()
    token = await enrollment.token(Approval.MANUAL)
    pending = await enrollment.service.enroll(
        envelope(key, token, now=enrollment.clock(), device_id="gate-1")
    )
    assert pending.status is EnrollmentStatus.PENDING
    assert enrollment.deployments.asked == []

    view = await enrollment.service.approve("gate-1", actor="user:admin", reason="checked")
    assert view.status == "accepted"
    assert enrollment.deployments.asked == ["gate-1"]
    assert await enrollment.status("gate-1") == "accepted"
    again = await enrollment.service.enroll(envelope(key, token, now=enrollment.clock()))
    assert again.status is EnrollmentStatus.ACCEPTED
    assert enrollment.provisioner.provisioned == ["gate-1"]
