"""Broker administration: per-device MQTT credentials and access control."""

from controlplane.broker.base import BrokerAdminError, BrokerProvisioner, Credentials

__all__ = ["BrokerAdminError", "BrokerProvisioner", "Credentials"]
