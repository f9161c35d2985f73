"""The REST API under ``/api/v1``: one module per resource, each exporting ``ENDPOINTS``.

:func:`all_endpoints` is the route table both the app (:mod:`controlplane.app`) and the
OpenAPI document (:mod:`controlplane.openapi`) are built from, so the two cannot drift apart.
"""

from __future__ import annotations

from mcp_edge.controlplane.api import (
    approvals,
    apps,
    audit,
    deployments,
    devices,
    drift,
    enroll,
    hard_examples,
    models,
    rollouts,
    tokens,
    users,
)
from mcp_edge.controlplane.api.common import Endpoint


def all_endpoints() -> list[Endpoint]:
    """Every REST endpoint, in documentation order."""
    return [
        *enroll.ENDPOINTS,
        *devices.ENDPOINTS,
        *approvals.ENDPOINTS,
        *tokens.ENDPOINTS,
        *users.ENDPOINTS,
        *audit.ENDPOINTS,
        *models.ENDPOINTS,
        *deployments.ENDPOINTS,
        *rollouts.ENDPOINTS,
        *drift.ENDPOINTS,
        *hard_examples.ENDPOINTS,
        *apps.ENDPOINTS,
    ]
