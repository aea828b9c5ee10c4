"""Plexus: federated learning across hospitals without moving patient data."""

__version__ = "0.1.0"
