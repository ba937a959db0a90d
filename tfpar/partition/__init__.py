"""Partitioning decisions: the partition-count search for sparse variables (Parallax), and
later the tiling planner."""
from tfpar.partition.partitioner import Group, marked_groups, partitioner
from tfpar.partition.search import PartitionSearch, Sample, SearchResult
from tfpar.partition.trials import (GroupDecision, cache_key, cache_path, check_groups, decide,
                                    remembered, timed_steps, training_step)

__all__ = ["Group", "GroupDecision", "PartitionSearch", "Sample", "SearchResult", "cache_key",
           "cache_path", "check_groups", "decide", "marked_groups", "partitioner", "remembered",
           "timed_steps", "training_step"]
