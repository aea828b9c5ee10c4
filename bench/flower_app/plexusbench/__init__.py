"""Plexus benchmark workload for Flower (numpy only)."""
