"""The sans-io protocol core: topics and typed messages, shared by agent and control plane.

Import what you need from here::

    from shared.protocol import topics, encode, decode, InferRequest

No module in this package performs I/O; transports live in ``agent`` and ``controlplane``.
Names are loaded on first use (PEP 562), so a process that needs only the inference messages
does not pay for every message family.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shared.protocol import topics

_EXPORTS: dict[str, str] = {
    "BatchingPolicy": "shared.protocol.state",
    "BrokerCredentials": "shared.protocol.enrollment",
    "CanarySpec": "shared.protocol.state",
    "CommandName": "shared.protocol.command",
    "CommandReply": "shared.protocol.command",
    "CommandRequest": "shared.protocol.command",
    "Datatype": "shared.protocol.wire",
    "DeploymentEvent": "shared.protocol.state",
    "DeploymentPhase": "shared.protocol.state",
    "DesiredModel": "shared.protocol.state",
    "DesiredState": "shared.protocol.state",
    "DriftReport": "shared.protocol.telemetry",
    "EnrollmentAnswer": "shared.protocol.enrollment",
    "EnrollmentRequest": "shared.protocol.enrollment",
    "EnrollmentStatus": "shared.protocol.enrollment",
    "ErrorCode": "shared.protocol.wire",
    "ErrorReply": "shared.protocol.command",
    "EventOutcome": "shared.protocol.state",
    "FeatureDrift": "shared.protocol.telemetry",
    "GpuSample": "shared.protocol.telemetry",
    "HealthSample": "shared.protocol.telemetry",
    "InferRequest": "shared.protocol.inference",
    "InferResponse": "shared.protocol.inference",
    "InferTensor": "shared.protocol.inference",
    "InferenceStats": "shared.protocol.telemetry",
    "LatencySummary": "shared.protocol.telemetry",
    "Message": "shared.protocol.base",
    "ModelInferenceStats": "shared.protocol.telemetry",
    "ModelStatus": "shared.protocol.state",
    "ReportedState": "shared.protocol.state",
    "RequestedOutput": "shared.protocol.inference",
    "TargetRef": "shared.protocol.state",
    "TelemetryPolicy": "shared.protocol.state",
    "TrustRoot": "shared.protocol.enrollment",
    "decode": "shared.protocol.codec",
    "decode_for_topic": "shared.protocol.codec",
    "encode": "shared.protocol.codec",
    "loads": "shared.protocol.wire",
    "new_nonce": "shared.protocol.enrollment",
    "schema_for_topic": "shared.protocol.codec",
    "sign_desired_state": "shared.protocol.state",
    "sign_enrollment": "shared.protocol.enrollment",
    "validate": "shared.protocol.codec",
    "verify_desired_state": "shared.protocol.state",
    "verify_enrollment": "shared.protocol.enrollment",
}

__all__ = [
    "BatchingPolicy",
    "BrokerCredentials",
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
    "FeatureDrift",
    "GpuSample",
    "HealthSample",
    "InferRequest",
    "InferResponse",
    "InferTensor",
    "InferenceStats",
    "LatencySummary",
    "Message",
    "ModelInferenceStats",
    "ModelStatus",
    "ReportedState",
    "RequestedOutput",
    "TargetRef",
    "TelemetryPolicy",
    "TrustRoot",
    "decode",
    "decode_for_topic",
    "encode",
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
    from shared.protocol.base import (
        Message,
    )
    from shared.protocol.codec import (
        decode,
        decode_for_topic,
        encode,
        schema_for_topic,
        validate,
    )
    from shared.protocol.command import (
        CommandName,
        CommandReply,
        CommandRequest,
        ErrorReply,
    )
    from shared.protocol.enrollment import (
        BrokerCredentials,
        EnrollmentAnswer,
        EnrollmentRequest,
        EnrollmentStatus,
        TrustRoot,
        new_nonce,
        sign_enrollment,
        verify_enrollment,
    )
    from shared.protocol.inference import (
        InferRequest,
        InferResponse,
        InferTensor,
        RequestedOutput,
    )
    from shared.protocol.state import (
        BatchingPolicy,
        CanarySpec,
        DeploymentEvent,
        DeploymentPhase,
        DesiredModel,
        DesiredState,
        EventOutcome,
        ModelStatus,
        ReportedState,
        TargetRef,
        TelemetryPolicy,
        sign_desired_state,
        verify_desired_state,
    )
    from shared.protocol.telemetry import (
        DriftReport,
        FeatureDrift,
        GpuSample,
        HealthSample,
        InferenceStats,
        LatencySummary,
        ModelInferenceStats,
    )
    from shared.protocol.wire import Datatype, ErrorCode, loads


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
