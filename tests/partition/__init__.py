"""Tests of tfpar.partition: the partition-count search (counts/) and the tiling planner (tiling/)."""
