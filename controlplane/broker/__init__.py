"""Broker administration: per-device MQTT credentials and access control."""

from mcp_edge.controlplane.broker.base import BrokerAdminError, BrokerProvisioner, Credentials

__all__ = ["BrokerAdminError", "BrokerProvisioner", "Credentials"]
