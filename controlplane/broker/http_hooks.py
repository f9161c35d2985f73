"""The HTTP endpoints brokers call to authenticate clients and check their ACLs.

Each broker's own request and answer shapes, served from the control plane's app::

    POST /broker/v1/emqx/authn       EMQX 5 HTTP authenticator: {username, password, clientid}
                                     -> 200 {"result": "allow"|"deny", "is_superuser": false}
    POST /broker/v1/emqx/authz       EMQX 5 HTTP authorizer: {username, clientid, topic,
                                     action: publish|subscribe, qos?, retain?}
                                     -> 200 {"result": "allow"|"deny"}
    POST /broker/v1/vernemq          VerneMQ webhooks, named by the ``vernemq-hook`` header:
                                     auth_on_register(_m5), auth_on_publish(_m5),
                                     auth_on_subscribe(_m5) -> 200 {"result": "ok"} or
                                     {"result": {"error": "not_allowed"}}; a subscription with
                                     some topics refused lists every topic with its granted
                                     QoS or 128 (v3) / 135 (v5)
    POST /broker/v1/go-auth/user     mosquitto-go-auth HTTP backend, JSON params:
    POST /broker/v1/go-auth/superuser  {username, password, clientid} / {username} /
    POST /broker/v1/go-auth/acl      {username, clientid, topic, acc: 1 read, 2 write,
                                     3 read+write, 4 subscribe} -> 200 {"ok": true, "error": ""}
                                     or 403 {"ok": false, "error": why}: right in both its
                                     ``status`` and ``json`` response modes

Nobody but the broker may ask: every request carries the shared secret of
``broker_auth_secret_file`` as ``Authorization: Bearer <secret>`` (EMQX sends configured
headers) or as the password of HTTP basic credentials (VerneMQ's hackney and go-auth's Go client
turn ``http://user:<secret>@host`` into them); without it the answer is 401 before the body is
read. The secret is what guards the endpoint, wherever it listens: the routes are mounted on
the control plane's app (:func:`attach_broker_hooks`), and serve can also open a listener for
the brokers alone (:func:`serve_broker_hooks`, ``broker_auth_listen``), up before the app's
startup, because the control plane's own broker sessions log in through these very endpoints
and the main listener opens only after they are up. It travels in a header: use HTTPS or a
private network between broker and control plane.

Bodies are small: more than :data:`MAX_BODY_BYTES` is 413, not JSON is 415, a missing field or a
field of the wrong type or length is 400 with the field named. A well-formed question about an
unknown account, a disabled one, another client id, a wrong password or a topic outside the
account's role is answered no, in the broker's terms. Passwords are never logged.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from mcp_edge.controlplane.api.common import ApiError, error_middleware, json_response, read_json
from mcp_edge.controlplane.auth import AuthError
from mcp_edge.controlplane.broker.grants import Access, Grant, Verdict
from mcp_edge.controlplane.broker.http_auth import HttpAuthProvisioner
from mcp_edge.controlplane.httplog import server_logging
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.shared.protocol.command import ErrorCode

log = logging.getLogger(__name__)

PREFIX = "/broker/v1"
MAX_BODY_BYTES = 16 * 1024
MAX_TEXT = 1024
"""Longest username, password or client id accepted (characters); longer is 400."""
MAX_TOPIC = 4096
MAX_TOPICS = 64
"""Most topics one VerneMQ subscription check may carry."""
VERNEMQ_HOOK = "vernemq-hook"
NOT_ALLOWED = {"result": {"error": "not_allowed"}}
VERNEMQ_REFUSED_QOS = {"auth_on_subscribe": 128, "auth_on_subscribe_m5": 135}
GO_AUTH_ACC = {
    1: (Access.RECEIVE,),
    2: (Access.PUBLISH,),
    3: (Access.RECEIVE, Access.PUBLISH),
    4: (Access.SUBSCRIBE,),
}

Body = dict[str, Any]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def attach_broker_hooks(
    app: web.Application, provisioner: HttpAuthProvisioner, secret: str
) -> None:
    """Serve the broker endpoints from ``app``, answering with ``provisioner``'s accounts to
    callers that present ``secret``; at cleanup, write the account changes still in memory."""
    hooks = app[HOOKS] = BrokerHooks(provisioner, secret)
    for path, handler in (
        ("/emqx/authn", hooks.emqx_authn),
        ("/emqx/authz", hooks.emqx_authz),
        ("/vernemq", hooks.vernemq),
        ("/go-auth/user", hooks.go_auth_user),
        ("/go-auth/superuser", hooks.go_auth_superuser),
        ("/go-auth/acl", hooks.go_auth_acl),
    ):
        app.router.add_post(PREFIX + path, hooks.guarded(handler))

    async def flush(app: web.Application) -> None:
        await provisioner.flush()

    app.on_cleanup.append(flush)


@asynccontextmanager
async def serve_broker_hooks(
    provisioner: HttpAuthProvisioner, secret: str, host: str, port: int
) -> AsyncIterator[str]:
    """Answer the brokers on a listener of their own (``host:port``; port 0 picks a free one)
    while the block runs; yields its base URL. Raises OSError when it cannot listen."""
    app = web.Application(
        client_max_size=MAX_BODY_BYTES, middlewares=[error_middleware(ControlPlaneMetrics())]
    )
    attach_broker_hooks(app, provisioner, secret)
    runner = web.AppRunner(app, access_log=None, **server_logging())
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        yield f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
    finally:
        await runner.cleanup()


class BrokerHooks:
    """The handlers; each reads a validated body and answers in its broker's dialect."""

    def __init__(self, provisioner: HttpAuthProvisioner, secret: str) -> None:
        if not secret:
            raise ValueError("the broker endpoint needs a secret")
        self._provisioner = provisioner
        self._secret = secret.encode()

    def guarded(self, handler: Callable[[Body, web.Request], Awaitable[web.Response]]) -> Handler:
        """``handler`` behind the secret check and the body reading."""

        async def guarded_handler(request: web.Request) -> web.StreamResponse:
            self._check_caller(request)
            body = await read_json(request, MAX_BODY_BYTES)
            if not isinstance(body, dict):
                raise ApiError(ErrorCode.BAD_REQUEST, "the body must be a JSON object")
            return await handler(body, request)

        return guarded_handler

    def _check_caller(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        scheme, _, value = header.partition(" ")
        presented = b""
        if scheme.lower() == "bearer":
            presented = value.strip().encode()
        elif scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(value.strip(), validate=True)
            except (binascii.Error, ValueError):
                decoded = b""
            presented = decoded.partition(b":")[2]
        if not presented or not hmac.compare_digest(presented, self._secret):
            raise AuthError(
                "the broker endpoints need the shared secret (Authorization: Bearer <secret>, "
                "or HTTP basic credentials with the secret as password)"
            )

    # ---- EMQX 5 ---------------------------------------------------------------------------

    async def emqx_authn(self, body: Body, request: web.Request) -> web.Response:
        username = _text(body, "username")
        password = _text(body, "password")
        client_id = _text(body, "clientid")
        _optional_text(body, "peerhost")
        verdict = await self._provisioner.authenticate(username, password, client_id)
        _log_denial("login", verdict, username, client_id)
        return json_response({"result": _emqx(verdict.allowed), "is_superuser": False})

    async def emqx_authz(self, body: Body, request: web.Request) -> web.Response:
        username = _text(body, "username")
        client_id = _text(body, "clientid")
        topic = _text(body, "topic", limit=MAX_TOPIC)
        action = _text(body, "action")
        if action not in ("publish", "subscribe"):
            raise ApiError(ErrorCode.BAD_REQUEST, "action: must be 'publish' or 'subscribe'")
        _optional_qos(body, "qos")
        _optional_flag(body, "retain")
        grant = await self._provisioner.grant(username, client_id)
        if isinstance(grant, Grant):
            allowed = (
                grant.permits(Access.PUBLISH, topic)
                if action == "publish"
                # EMQX asks about the real filter of a shared subscription ($share/g/ removed).
                else grant.permits_shared_real_topic(topic)
            )
            verdict = Verdict.ALLOW if allowed else Verdict.NOT_PERMITTED
        else:
            verdict = grant
        _log_denial(action, verdict, username, client_id, topic)
        return json_response({"result": _emqx(verdict.allowed)})

    # ---- VerneMQ ----------------------------------------------------------------------------

    async def vernemq(self, body: Body, request: web.Request) -> web.Response:
        hook = request.headers.get(VERNEMQ_HOOK, "")
        if hook in ("auth_on_register", "auth_on_register_m5"):
            return await self._vernemq_register(body)
        if hook in ("auth_on_publish", "auth_on_publish_m5"):
            return await self._vernemq_publish(body)
        if hook in VERNEMQ_REFUSED_QOS:
            return await self._vernemq_subscribe(body, hook)
        raise ApiError(
            ErrorCode.BAD_REQUEST,
            f"{VERNEMQ_HOOK} header {hook[:64]!r} is not an auth hook this endpoint serves",
        )

    async def _vernemq_register(self, body: Body) -> web.Response:
        username = _optional_text(body, "username", nullable=True)
        password = _optional_text(body, "password", nullable=True)
        client_id = _text(body, "client_id")
        _optional_text(body, "mountpoint")
        verdict = await self._provisioner.authenticate(username, password, client_id)
        _log_denial("login", verdict, username, client_id)
        return json_response({"result": "ok"} if verdict.allowed else NOT_ALLOWED)

    async def _vernemq_publish(self, body: Body) -> web.Response:
        username = _optional_text(body, "username", nullable=True)
        client_id = _text(body, "client_id")
        topic = _text(body, "topic", limit=MAX_TOPIC)
        _optional_text(body, "mountpoint")
        _optional_qos(body, "qos")
        _optional_flag(body, "retain")
        grant = await self._provisioner.grant(username, client_id)
        verdict = _topic_verdict(grant, Access.PUBLISH, topic)
        _log_denial("publish", verdict, username, client_id, topic)
        return json_response({"result": "ok"} if verdict.allowed else NOT_ALLOWED)

    async def _vernemq_subscribe(self, body: Body, hook: str) -> web.Response:
        username = _optional_text(body, "username", nullable=True)
        client_id = _text(body, "client_id")
        _optional_text(body, "mountpoint")
        wanted = _subscriptions(body)
        grant = await self._provisioner.grant(username, client_id)
        if not isinstance(grant, Grant):
            _log_denial("subscribe", grant, username, client_id)
            return json_response(NOT_ALLOWED)
        allowed = [grant.permits(Access.SUBSCRIBE, topic) for topic, _ in wanted]
        for (topic, _), ok in zip(wanted, allowed, strict=True):
            _log_denial("subscribe", Verdict.ALLOW if ok else Verdict.NOT_PERMITTED,
                        username, client_id, topic)  # fmt: skip
        if all(allowed):
            return json_response({"result": "ok"})
        if not any(allowed):
            return json_response(NOT_ALLOWED)
        refused = VERNEMQ_REFUSED_QOS[hook]
        granted = [
            {"topic": topic, "qos": qos if ok else refused}
            for (topic, qos), ok in zip(wanted, allowed, strict=True)
        ]
        if hook == "auth_on_subscribe":
            return json_response({"result": "ok", "topics": granted})
        return json_response({"result": "ok", "modifiers": {"topics": granted}})

    # ---- mosquitto-go-auth --------------------------------------------------------------------

    async def go_auth_user(self, body: Body, request: web.Request) -> web.Response:
        username = _text(body, "username")
        password = _text(body, "password")
        client_id = _text(body, "clientid")
        verdict = await self._provisioner.authenticate(username, password, client_id)
        _log_denial("login", verdict, username, client_id)
        return _go_auth(verdict)

    async def go_auth_superuser(self, body: Body, request: web.Request) -> web.Response:
        _text(body, "username")
        return _go_auth(Verdict.NOT_PERMITTED)  # no account is a superuser

    async def go_auth_acl(self, body: Body, request: web.Request) -> web.Response:
        username = _text(body, "username")
        client_id = _text(body, "clientid")
        topic = _text(body, "topic", limit=MAX_TOPIC)
        acc = body.get("acc")
        if isinstance(acc, bool) or not isinstance(acc, int) or acc not in GO_AUTH_ACC:
            raise ApiError(ErrorCode.BAD_REQUEST, "acc: must be 1, 2, 3 or 4")
        grant = await self._provisioner.grant(username, client_id)
        verdict = Verdict.ALLOW
        for access in GO_AUTH_ACC[acc]:
            if verdict.allowed:
                verdict = _topic_verdict(grant, access, topic)
        _log_denial(f"acc {acc}", verdict, username, client_id, topic)
        return _go_auth(verdict)


HOOKS = web.AppKey("broker_hooks", BrokerHooks)


# ---- answers and field checks (pure) ---------------------------------------------------------


def _emqx(allowed: bool) -> str:
    return "allow" if allowed else "deny"


def _go_auth(verdict: Verdict) -> web.Response:
    if verdict.allowed:
        return json_response({"ok": True, "error": ""})
    return json_response({"ok": False, "error": verdict.value}, status=403)


def _topic_verdict(grant: Grant | Verdict, access: Access, topic: str) -> Verdict:
    if not isinstance(grant, Grant):
        return grant
    return Verdict.ALLOW if grant.permits(access, topic) else Verdict.NOT_PERMITTED


def _log_denial(
    what: str, verdict: Verdict, username: str | None, client_id: str, topic: str | None = None
) -> None:
    if not verdict.allowed:
        log.debug("broker %s denied: user %r, client %r, topic %r: %s",
                  what, username, client_id, topic, verdict.value)  # fmt: skip


def _bad(field: str, problem: str) -> ApiError:
    return ApiError(ErrorCode.BAD_REQUEST, f"{field}: {problem}")


def _text(body: Body, field: str, *, limit: int = MAX_TEXT) -> str:
    """The string ``body[field]``: present, a string, at most ``limit`` characters, no NUL."""
    value = _optional_text(body, field, limit=limit)
    if value is None:
        raise _bad(field, "is missing")
    return value


def _optional_text(
    body: Body, field: str, *, limit: int = MAX_TEXT, nullable: bool = False
) -> str | None:
    """``body[field]`` when present (None when absent, or null where ``nullable``)."""
    value = body.get(field)
    if value is None and (nullable or field not in body):
        return None
    if not isinstance(value, str):
        raise _bad(field, "must be a string")
    if len(value) > limit:
        raise _bad(field, f"is longer than {limit} characters")
    if "\x00" in value:
        raise _bad(field, "contains a NUL character")
    return value


def _optional_qos(body: Body, field: str) -> int | None:
    """A QoS: 0, 1 or 2, as a number or (EMQX renders placeholders as text) a string."""
    value = body.get(field)
    if value is None and field not in body:
        return None
    if isinstance(value, str) and value in ("0", "1", "2"):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2):
        raise _bad(field, "must be 0, 1 or 2")
    return value


def _optional_flag(body: Body, field: str) -> bool | None:
    """A boolean, as JSON or as the text ``true``/``false`` (EMQX placeholders)."""
    value = body.get(field)
    if value is None and field not in body:
        return None
    if isinstance(value, str) and value in ("true", "false"):
        return value == "true"
    if not isinstance(value, bool):
        raise _bad(field, "must be true or false")
    return value


def _subscriptions(body: Body) -> list[tuple[str, int]]:
    """VerneMQ's ``topics``: 1 to :data:`MAX_TOPICS` objects with a ``topic`` and a ``qos``."""
    wanted = body.get("topics")
    if not isinstance(wanted, list) or not 1 <= len(wanted) <= MAX_TOPICS:
        raise _bad("topics", f"must be a list of 1 to {MAX_TOPICS} subscriptions")
    out = []
    for i, entry in enumerate(wanted):
        if not isinstance(entry, dict):
            raise _bad(f"topics[{i}]", "must be an object with topic and qos")
        topic = _text(entry, "topic", limit=MAX_TOPIC)
        qos = _optional_qos(entry, "qos")
        if qos is None:
            raise _bad(f"topics[{i}].qos", "is missing")
        out.append((topic, qos))
    return out
