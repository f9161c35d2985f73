"""The sans-io protocol core: topics and typed messages, shared by agent and control plane.

Import what you need from here::

    from mcp_edge.shared.protocol import topics, encode, decode, InferRequest

No module in this package performs I/O; transports live in ``agent`` and ``controlplane``.
Names are loaded on first use (PEP 562), so a process that needs only the inference messages
does not pay for every message family.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mcp_edge.shared.protocol import topics

_EXPORTS: dict[str, str] = {
    "BatchingPolicy": "mcp_edge.shared.protocol.state",
    "BrokerCredentials": "mcp_edge.shared.protocol.enrollment",
    "CanaryPolicy": "mcp_edge.shared.protocol.canary",
    "CanarySpec": "mcp_edge.shared.protocol.state",
    "CommandName": "mcp_edge.shared.protocol.wire",
    "CommandReply": "mcp_edge.shared.protocol.command",
    "CommandRequest": "mcp_edge.shared.protocol.command",
    "Datatype": "mcp_edge.shared.protocol.wire",
    "DeploymentEvent": "mcp_edge.shared.protocol.state",
    "DeploymentPhase": "mcp_edge.shared.protocol.reports",
    "DesiredModel": "mcp_edge.shared.protocol.state",
    "DesiredState": "mcp_edge.shared.protocol.state",
    "DriftReport": "mcp_edge.shared.protocol.telemetry",
    "EnrollmentAnswer": "mcp_edge.shared.protocol.enrollment",
    "EnrollmentRequest": "mcp_edge.shared.protocol.enrollment",
    "EnrollmentStatus": "mcp_edge.shared.protocol.wire",
    "ErrorCode": "mcp_edge.shared.protocol.wire",
    "ErrorReply": "mcp_edge.shared.protocol.command",
    "EventOutcome": "mcp_edge.shared.protocol.reports",
    "EventReport": "mcp_edge.shared.protocol.reports",
    "FeatureDrift": "mcp_edge.shared.protocol.telemetry",
    "GpuReport": "mcp_edge.shared.protocol.reports",
    "GpuSample": "mcp_edge.shared.protocol.telemetry",
    "HealthReport": "mcp_edge.shared.protocol.reports",
    "HealthSample": "mcp_edge.shared.protocol.telemetry",
    "InferRequest": "mcp_edge.shared.protocol.inference",
    "InferResponse": "mcp_edge.shared.protocol.inference",
    "InferTensor": "mcp_edge.shared.protocol.inference",
    "InferenceReport": "mcp_edge.shared.protocol.reports",
    "InferenceStats": "mcp_edge.shared.protocol.telemetry",
    "LatencyReport": "mcp_edge.shared.protocol.reports",
    "LatencySummary": "mcp_edge.shared.protocol.telemetry",
    "Message": "mcp_edge.shared.protocol.base",
    "ModelInferenceReport": "mcp_edge.shared.protocol.reports",
    "ModelInferenceStats": "mcp_edge.shared.protocol.telemetry",
    "ModelStatus": "mcp_edge.shared.protocol.state",
    "ModelStatusReport": "mcp_edge.shared.protocol.reports",
    "ReportedState": "mcp_edge.shared.protocol.state",
    "RequestedOutput": "mcp_edge.shared.protocol.inference",
    "StateReport": "mcp_edge.shared.protocol.reports",
    "TargetRef": "mcp_edge.shared.protocol.state",
    "TelemetryPolicy": "mcp_edge.shared.protocol.state",
    "TrustRoot": "mcp_edge.shared.protocol.enrollment",
    "decode": "mcp_edge.shared.protocol.codec",
    "decode_for_topic": "mcp_edge.shared.protocol.codec",
    "encode": "mcp_edge.shared.protocol.codec",
    "encode_report": "mcp_edge.shared.protocol.reports",
    "loads": "mcp_edge.shared.protocol.wire",
    "new_nonce": "mcp_edge.shared.protocol.enrollment",
    "schema_for_topic": "mcp_edge.shared.protocol.codec",
    "sign_desired_state": "mcp_edge.shared.protocol.state",
    "sign_enrollment": "mcp_edge.shared.protocol.enrollment",
    "validate": "mcp_edge.shared.protocol.codec",
    "verify_desired_state": "mcp_edge.shared.protocol.state",
    "verify_enrollment": "mcp_edge.shared.protocol.enrollment",
}

__all__ = [
    "BatchingPolicy",
    "BrokerCredentials",
    "CanaryPolicy",
    "CanarySpec",
    "CommandName",
    "CommandReply",
    "CommandRequest",
    "Datatype",
    "DeploymentEvent",
    "DeploymentPhase",
    "DesiredModel",
    "DesiredState",
    "DriftReport",
    "EnrollmentAnswer",
    "EnrollmentRequest",
    "EnrollmentStatus",
    "ErrorCode",
    "ErrorReply",
    "EventOutcome",
    "EventReport",
    "FeatureDrift",
    "GpuReport",
    "GpuSample",
    "HealthReport",
    "HealthSample",
    "InferRequest",
    "InferResponse",
    "InferTensor",
    "InferenceReport",
    "InferenceStats",
    "LatencyReport",
    "LatencySummary",
    "Message",
    "ModelInferenceReport",
    "ModelInferenceStats",
    "ModelStatus",
    "ModelStatusReport",
    "ReportedState",
    "RequestedOutput",
    "StateReport",
    "TargetRef",
    "TelemetryPolicy",
    "TrustRoot",
    "decode",
    "decode_for_topic",
    "encode",
    "encode_report",
    "loads",
    "new_nonce",
    "schema_for_topic",
    "sign_desired_state",
    "sign_enrollment",
    "topics",
    "validate",
    "verify_desired_state",
    "verify_enrollment",
]

if TYPE_CHECKING:
    from mcp_edge.shared.protocol.base import (
        Message,
    )
    from mcp_edge.shared.protocol.canary import CanaryPolicy
    from mcp_edge.shared.protocol.codec import (
        decode,
        decode_for_topic,
        encode,
        schema_for_topic,
        validate,
    )
    from mcp_edge.shared.protocol.command import (
        CommandReply,
        CommandRequest,
        ErrorReply,
    )
    from mcp_edge.shared.protocol.enrollment import (
        BrokerCredentials,
        EnrollmentAnswer,
        EnrollmentRequest,
        TrustRoot,
        new_nonce,
        sign_enrollment,
        verify_enrollment,
    )
    from mcp_edge.shared.protocol.inference import (
        InferRequest,
        InferResponse,
        InferTensor,
        RequestedOutput,
    )
    from mcp_edge.shared.protocol.reports import (
        DeploymentPhase,
        EventOutcome,
        EventReport,
        GpuReport,
        HealthReport,
        InferenceReport,
        LatencyReport,
        ModelInferenceReport,
        ModelStatusReport,
        StateReport,
        encode_report,
    )
    from mcp_edge.shared.protocol.state import (
        BatchingPolicy,
        CanarySpec,
        DeploymentEvent,
        DesiredModel,
        DesiredState,
        ModelStatus,
        ReportedState,
        TargetRef,
        TelemetryPolicy,
        sign_desired_state,
        verify_desired_state,
    )
    from mcp_edge.shared.protocol.telemetry import (
        DriftReport,
        FeatureDrift,
        GpuSample,
        HealthSample,
        InferenceStats,
        LatencySummary,
        ModelInferenceStats,
    )
    from mcp_edge.shared.protocol.wire import (
        CommandName,
        Datatype,
        EnrollmentStatus,
        ErrorCode,
        loads,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
