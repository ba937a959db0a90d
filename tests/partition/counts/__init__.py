"""Tests of tfpar.partition.counts (Parallax's partition-count search)."""
