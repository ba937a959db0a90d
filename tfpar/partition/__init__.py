"""Partitioning decisions, two concepts in two sub-packages:

- `tfpar.partition.counts`: how many row ranges a sparse variable on the parameter
  servers gets (Parallax's partition-count search: `tfpar.partitioner` marks, timed
  trials, the sampling-and-fit search).
- `tfpar.partition.tiling`: how large dense layers are split across devices (SoyBean's
  k-cut tilings, the exact and recursive planners, FlexFlow-style simulation).

Importing this package imports nothing else, so the pure parts of either (the count
search, the tiling model and planner) load without TensorFlow.
"""
