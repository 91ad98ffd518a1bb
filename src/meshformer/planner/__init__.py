"""Knowing before running: memory and throughput estimates from the config alone (no model built)."""
