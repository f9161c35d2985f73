"""The OpenAPI document says exactly what the control plane enforces: a schema-driven fuzzer
(schemathesis) sends every operation of a throwaway control plane (SQLite, the fake
provisioner, no broker) requests that keep to the document and requests that break it, and
checks each answer: never a 5xx, only documented statuses and content types, answers that
match their schemas, data that breaks the document refused (4xx) and data that keeps to it not
refused as invalid.

Every request carries a fresh admin token (a login per request), so an operation that revokes
API tokens cannot lock the fuzzer out of the others; the fuzzer makes up no credentials of its
own (what a missing or bad token gets is tested in test_controlplane_api). Generation is seeded
and derandomized: each run sends the same requests.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import requests
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from mcp_edge.controlplane.app import OPENAPI, create_app
from mcp_edge.controlplane.bootstrap import initialize
from mcp_edge.controlplane.settings import PasswordCost, Settings
from tests.support.controlplane import ADMIN_PASSWORD, FakeClock, FakeProvisioner, served

# A name the fuzzer's usernames (PATCH /api/v1/users/{username}) will not hit, so it never
# changes the password this test logs in with.
ADMIN = "fuzz-owner-7f3c2a91d4"
MAX_EXAMPLES = 12
SEED = 20260501
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    positive_data_acceptance,
]
# Rules no JSON Schema can state: a request that keeps to the document may still be refused
# (400) for these reasons alone, and the answer must say which.
BEYOND_THE_SCHEMA = {
    "POST /api/v1/bundles": re.compile(r"^bundle refused: "),
    "POST /api/v1/enroll": re.compile(r"^enrollment request: public_key: |timestamp"),
    "POST /api/v1/publishers": re.compile(r"^public_key: "),
    "POST /api/v1/preauthorizations": re.compile(r"^public_key: "),
    "POST /api/v1/deployments": re.compile(r"must differ from the stable version"),
    "PATCH /api/v1/devices/{device_id}/labels": re.compile(r"both set and removed"),
    # The rollout spec's rules across fields (controlplane.rollouts.spec).
    "POST /api/v1/rollouts": re.compile(
        r"can never fail|needs a shadow stage|exactly one of count or percent|"
        r"applies to canary stages only|one per metric and stage|percents sum to|"
        r"last stage must be a percent stage|the target selects nothing|listed twice|"
        r"\.threshold: .* is out of range"  # each metric's own range
    ),
}
# Every operation: no string may hold a NUL character (the document's description says so).
NUL_REFUSED = re.compile(r"contains a NUL character")


def served_document() -> dict[str, Any]:
    """The document the app serves; building the app touches neither disk nor network."""
    app = create_app(Settings(data_dir=Path("unused")), FakeProvisioner())
    return dict(orjson.loads(app[OPENAPI]))


CONFIG = schemathesis.Config.from_dict(
    {
        "seed": SEED,
        "cache": {"enabled": False},
        "generation": {
            "max-examples": MAX_EXAMPLES,
            "deterministic": True,
            "database": "none",
            "with-security-parameters": False,
        },
        # A body over the size cap is refused too (413), before its schema is read.
        "checks": {
            "negative_data_rejection": {
                "expected-statuses": [
                    "400",
                    "401",
                    "403",
                    "404",
                    "405",
                    "406",
                    "409",
                    "413",
                    "415",
                    "422",
                    "428",
                    "429",
                ]
            }
        },
        "phases": {
            "examples": {"enabled": True},
            "coverage": {"enabled": True},
            "fuzzing": {"enabled": True},
            "stateful": {"enabled": False},
        },
    }
)
# Collected from the document the app builds (schemathesis makes one test per operation at
# collection time, before any server runs); a test checks that the live control plane serves
# exactly this document.
schema = schemathesis.openapi.from_dict(served_document(), config=CONFIG)


def fresh_admin_token(url: str) -> str:
    """A new admin API token, from ``POST /api/v1/auth/login``."""
    answer = requests.post(
        f"{url}/api/v1/auth/login",
        json={"username": ADMIN, "password": ADMIN_PASSWORD, "token_name": "fuzz"},
        timeout=30,
    )
    assert answer.status_code == 201, answer.text
    return str(answer.json()["token"])


@pytest.fixture(scope="module")
def live_cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("fuzzed-cp")
    settings = Settings(
        data_dir=root / "cp",
        database_url=f"sqlite:///{root / 'cp.db'}",
        password_cost=PasswordCost.MIN,
        broker_urls=("mqtt://broker.test:1883",),
        port=0,
    )
    clock = FakeClock()
    asyncio.run(initialize(settings, clock=clock, admin_user=ADMIN, admin_password=ADMIN_PASSWORD))
    with served(settings, FakeProvisioner(), clock) as url:
        yield url


def test_the_fuzzed_document_is_the_one_served(live_cp: str) -> None:
    answer = requests.get(f"{live_cp}/api/v1/openapi.json", timeout=30)
    assert answer.status_code == 200
    assert answer.json() == served_document()


@schema.parametrize()
@pytest.mark.timeout(600)
def test_every_operation_answers_as_its_document_says(case: Any, live_cp: str) -> None:
    headers = {"Authorization": f"Bearer {fresh_admin_token(live_cp)}"}
    response = case.call(base_url=live_cp, headers=headers, timeout=30)
    label = f"{case.method.upper()} {case.path}"
    refusal = BEYOND_THE_SCHEMA.get(label)
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    checks = CHECKS
    if positive and response.status_code == 400:
        message = response.json()["error"]
        if NUL_REFUSED.search(message) is None:
            assert refusal is not None and refusal.search(message), (
                f"{label} refused a valid request: {message}"
            )
        checks = [c for c in CHECKS if c is not positive_data_acceptance]
    case.validate_response(response, checks=checks, headers=headers)
    if case.operation.definition.raw.get("security"):
        # A fresh admin token is never refused, whatever the operation did before.
        assert response.status_code != 401, f"{label}: {response.text}"


def test_a_body_is_required_exactly_where_a_request_without_one_is_refused(live_cp: str) -> None:
    doc = requests.get(f"{live_cp}/api/v1/openapi.json", timeout=30).json()
    auth = {"Authorization": f"Bearer {fresh_admin_token(live_cp)}"}

    token_op = doc["paths"]["/api/v1/enrollment-tokens"]["post"]
    assert token_op["requestBody"]["required"] is False
    created = requests.post(f"{live_cp}/api/v1/enrollment-tokens", headers=auth, timeout=30)
    assert created.status_code == 201, created.text
    assert created.json()["approval"] == "auto" and created.json()["token"].startswith("mcpe_")

    user_op = doc["paths"]["/api/v1/users"]["post"]
    assert user_op["requestBody"]["required"] is True
    refused = requests.post(f"{live_cp}/api/v1/users", headers=auth, timeout=30)
    assert refused.status_code == 400 and "username" in refused.json()["error"], refused.text
