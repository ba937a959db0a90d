"""Communication cost model: bytes each worker sends plus receives per training step.

Formulas from Parallax (EuroSys'19) section 3.1, Table 3, for ring collectives as in NCCL
and Gloo; w is a variable's size in bytes, N the number of workers.
"""
from __future__ import annotations


def allreduce_bytes(w: float, n: int) -> float:
    """Ring allreduce: 2(N-1) steps sending and receiving w/N each: 4w(N-1)/N."""
    return 4.0 * w * (n - 1) / n if n > 1 else 0.0


def allgather_bytes(per_worker: float, n: int) -> float:
    """Ring allgather of `per_worker` bytes from each worker: N-1 steps in and out: 2s(N-1)."""
    return 2.0 * per_worker * (n - 1) if n > 1 else 0.0


def sharded_bytes(values: float, ids: float, n: int) -> float:
    """Rows split over the workers, exchanged by all-to-all (route "sharded"): a worker
    sends the (N-1)/N of its ids and row gradients that other workers own and gets those
    rows back, and serves as much for the others: 4(values + ids)(N-1)/N."""
    return 4.0 * (values + ids) * (n - 1) / n if n > 1 else 0.0


def ps_bytes(w: float, n: int) -> float:
    """Variables balanced over parameter servers, one per machine: each machine pulls and
    pushes its w for the (N-1)/N remote part and serves as much: 4w(N-1)/N (Table 3, m
    variables; w is alpha times the variable's size for a sparse one)."""
    return 4.0 * w * (n - 1) / n if n > 1 else 0.0
