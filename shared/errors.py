"""The exception tree of ``shared``, drawn in one place.

::

    McpError                         base of every error raised by MCP Edge code
    ├── ProtocolError                a message or topic from a peer is unusable (do not retry)
    │   ├── TopicError               topic string malformed, or a device/model id is invalid
    │   ├── MessageError             payload too large, not JSON, or fails its schema
    │   ├── ReplayError              sequence number or nonce seen before
    │   └── ExpiredError             document past its expiry, or timestamp too far off
    ├── SigningError                 keys and signatures
    │   ├── KeyFileError             key file missing, malformed, or readable by group/others
    │   ├── MalformedSignatureError  signed document or signature is not well formed
    │   ├── UnknownSignerError       no trusted key with the signature's key id
    │   ├── WrongKeyError            the key given does not match the key id asked for
    │   └── BadSignatureError        signature does not verify (tampered or forged)
    ├── BundleError                  a .mcpb bundle is unusable; ``member`` names the file at fault
    │   └── ModelValidationError     the model inside does not load or check
    └── VersionError                 a version string is not semver, or cannot be mapped

Errors from libraries (PyNaCl, onnx, tarfile) are translated where they enter and chained with
``raise ... from``; callers above ``shared`` only see these types.
"""

from __future__ import annotations


class McpError(Exception):
    """Base class of every MCP Edge error."""


class ProtocolError(McpError):
    """A peer sent something that cannot be used; retrying the same bytes will not help."""


class TopicError(ProtocolError):
    """A topic or an identifier embedded in a topic is malformed."""


class MessageError(ProtocolError):
    """A payload is too large, is not JSON, or does not match its schema."""


class SigningError(McpError):
    """Base class for key and signature errors."""


class KeyFileError(SigningError):
    """A key file is missing, malformed, or has unsafe permissions."""


class MalformedSignatureError(SigningError):
    """A signed document or one of its signatures is not well formed."""


class UnknownSignerError(SigningError):
    """A signature names a key id that is not among the trusted keys."""


class WrongKeyError(SigningError):
    """A key was used against a key id that is not its own."""


class BadSignatureError(SigningError):
    """A signature does not verify: the data was tampered with or the signature forged."""


class BundleError(McpError):
    """A bundle is malformed, tampered with, or unsafe to unpack.

    ``member`` names the file inside the bundle at fault, when there is one.
    """

    def __init__(self, message: str, member: str | None = None) -> None:
        super().__init__(message)
        self.member = member


class ModelValidationError(BundleError):
    """The model file does not pass its format's checks (ONNX checker, TFLite load)."""


class VersionError(McpError, ValueError):
    """A version string is not valid semver, or is outside what a mapping can encode."""


class ReplayError(ProtocolError):
    """A signed document or request was seen before (sequence number or nonce not fresh)."""


class ExpiredError(ProtocolError):
    """A signed document or request is past its expiry (or its timestamp is too far off)."""
