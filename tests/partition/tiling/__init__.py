"""Tests of tfpar.partition.tiling (the SoyBean/FlexFlow tiling planner and simulator)."""
