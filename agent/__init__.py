"""The MCP Edge device agent: hardware profiles, local inference, the fleet session."""

__version__ = "0.1.0"
