"""The sans-io protocol core: topics and typed messages, shared by agent and control plane.

Import what you need from here::

    from shared.protocol import topics, encode, decode, InferRequest

No module in this package performs I/O; transports live in ``agent`` and ``controlplane``.
"""

from shared.protocol import topics
from shared.protocol.base import Message
from shared.protocol.codec import (
    decode,
    decode_for_topic,
    encode,
    loads,
    schema_for_topic,
    validate,
)
from shared.protocol.command import (
    CommandName,
    CommandReply,
    CommandRequest,
    ErrorCode,
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
    Datatype,
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
