"""Measurements of the real routing code in one process (wall clock, not simulated time)."""
