"""Partition counts of sparse variables (Parallax, section 3.2).

- `partitioner`: `tfpar.partitioner()`, which marks the variables whose count is searched.
- `search` (pure): the sampling-and-fit search over counts, t(P) = a + b/P + cP.
- `trials`: the search inside a running job (timed trial runners, agreement, the cache).

Names of `partitioner` and `trials` load on first use (they need TensorFlow); `search`
imports without it.
"""
import importlib as _importlib

_LAZY = {
    "partitioner": "partitioner", "Group": "partitioner", "marked_groups": "partitioner",
    "GroupDecision": "trials", "cache_key": "trials", "cache_path": "trials",
    "check_groups": "trials", "decide": "trials", "remembered": "trials", "resolve_counts": "trials",
    "timed_steps": "trials", "training_step": "trials",
    "PartitionSearch": "search", "Sample": "search", "SearchResult": "search",
}


def __getattr__(name):
    if name in _LAZY:
        module = _importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
