"""Plexus simulation: one job on many virtual sites on one machine (`plexus simulate`)."""
