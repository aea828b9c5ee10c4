"""Flower side of the `plexus simulate` benchmark (bench/flower_sim.py runs it on Flower's simulation engine)."""
