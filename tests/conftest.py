"""Fixtures shared by every test: real brokers, a fresh PostgreSQL database, real models.

- `mosquitto` / `mosquitto_dynsec`: one broker per session (anonymous / dynamic-security).
- `fresh_mosquitto`: a broker of its own for a test that kills or restarts it.
- `postgres_url`: a throw-away database on the server named by `MCP_TEST_POSTGRES_URL`.
- `digits`: a digits MLP trained once per session, saved as ONNX and as a TFLite twin.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from mcp_edge.tooling.models import DigitsModels, make_digits_models
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker, MosquittoBroker

POSTGRES_URL_ENV = "MCP_TEST_POSTGRES_URL"
PROFILE_ENV = "MCP_PROFILE"

# Agents the tests start (`mcp-agent serve/run` as processes, which read MCP_PROFILE) run on the
# generic profile, so their answers are onnxruntime's whatever CPU runs the suite: detection
# would pick intel-xeon on a Xeon, whose OpenVINO backend uses bf16 where the CPU has it.
# Tests of another profile name it (--profile); tests of detection remove this (test_hardware).
os.environ.setdefault(PROFILE_ENV, "generic-x86_64")


@pytest.fixture(scope="session")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    """A broker shared by the session, anonymous clients allowed. Do not stop or kill it."""
    with MosquittoBroker(tmp_path_factory.mktemp("mosquitto")) as broker:
        yield broker


@pytest.fixture(scope="session")
def mosquitto_dynsec(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[DynsecMosquittoBroker]:
    """A session broker with the dynamic-security plugin; only `admin_username` can log in."""
    with DynsecMosquittoBroker(tmp_path_factory.mktemp("mosquitto-dynsec")) as broker:
        yield broker


@pytest.fixture
def fresh_mosquitto(tmp_path: Path) -> Iterator[MosquittoBroker]:
    """An anonymous broker owned by one test, which may `kill()`, `stop()` and `start()` it."""
    broker_dir = tmp_path / "mosquitto"
    broker_dir.mkdir()
    with MosquittoBroker(broker_dir) as broker:
        yield broker


def _with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + database))


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """The URL of a new, empty database, dropped at the end of the session.

    The server comes from `MCP_TEST_POSTGRES_URL` (e.g.
    `postgresql://postgres@127.0.0.1:5432/postgres`); the test is skipped when it is unset.
    """
    server_url = os.environ.get(POSTGRES_URL_ENV)
    if not server_url:
        pytest.skip(
            f"{POSTGRES_URL_ENV} is not set; PostgreSQL tests need a server "
            "(tests/run.sh sets it in CI)"
        )
    import psycopg
    from psycopg import sql

    database = f"mcp_test_{secrets.token_hex(6)}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    try:
        yield _with_database(server_url, database)
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
            )


@pytest.fixture(scope="session")
def digits(tmp_path_factory: pytest.TempPathFactory) -> DigitsModels:
    """A digits MLP trained once per session, written as digits.onnx and digits.tflite."""
    return make_digits_models(tmp_path_factory.mktemp("digits"), seed=0)
