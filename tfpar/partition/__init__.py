"""Partitioning decisions, two concepts in two sub-packages:

- `tfpar.partition.counts`: how many row ranges a sparse variable on the parameter
  servers gets (Parallax's sampling-and-fit search; what marks the variables and the
  timed trials in a job are in the graph and runtime layers).
- `tfpar.partition.tiling`: how large dense layers are split across devices (SoyBean's
  k-cut tilings, the exact and recursive planners, FlexFlow-style simulation).

Both are pure (no TensorFlow): the decision layer, beside `tfpar.plan`. What reads a
graph for them is `tfpar.graph` (`extract`, `partitioner`).
"""
