"""Partition search for sparse variables and the tiling planner (issues 4 and 5)."""
