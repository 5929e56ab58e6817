"""Trace replay and (later) the fleet simulator for demos, tests and benchmarks."""
