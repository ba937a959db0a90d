"""Exact minimisation of a sum of small cost tables over discrete variables.

The tiling planner's problem is min over assignments x of sum_f table_f[x_f], each table
over the (two or three) matrices a matmul uses. Min-plus variable elimination solves it
exactly: eliminating a variable v adds the tables that use v (by numpy broadcasting) and
minimises over v, leaving one table over v's neighbours; the argmin tables give the
assignment back. The work is set by the largest table formed, which the greedy order
(smallest table first) keeps small on layer chains: for SoyBean's one-cut DP over BFS
levels this is the same computation with the frontier as the table, vectorised.

`elimination_order` predicts the largest table before any work, so callers can fall back
to a cheaper, inexact method when the exact one would not fit (`TooLarge`).
"""
from __future__ import annotations

import heapq
from typing import Dict, Hashable, List, Sequence, Tuple

import numpy as np

Factor = Tuple[Tuple[Hashable, ...], np.ndarray]  # variables (distinct), table over them


class TooLarge(Exception):
    """The elimination would form a table of more entries than the budget allows."""


def elimination_order(domains: Dict[Hashable, int], scopes: Sequence[Sequence[Hashable]],
                      budget: float = float("inf"), work: float = float("inf")
                      ) -> Tuple[List[Hashable], int]:
    """A greedy elimination order (smallest combined table first) and its largest table.

    Raises TooLarge as soon as the cheapest next step exceeds `budget` entries, or all
    the tables formed so far exceed `work` entries in total."""
    scope_sets: Dict[int, frozenset] = {i: frozenset(s) for i, s in enumerate(scopes)}
    of_var: Dict[Hashable, set] = {v: set() for v in domains}
    for i, s in scope_sets.items():
        for v in s:
            of_var[v].add(i)

    def size(v) -> int:
        union = frozenset().union(*(scope_sets[i] for i in of_var[v])) | {v}
        n = 1
        for u in union:
            n *= domains[u]
        return n

    version = {v: 0 for v in domains}
    heap = [(size(v), repr(v), 0, v) for v in domains]
    heapq.heapify(heap)
    order: List[Hashable] = []
    largest, formed, next_id = 0, 0, len(scope_sets)
    while heap:
        n, _, ver, v = heapq.heappop(heap)
        if v not in version or ver != version[v]:
            continue  # stale entry
        formed += n
        if n > budget or formed > work:
            raise TooLarge(f"eliminating {v!r} forms a table of {n} entries "
                           f"({formed} in all)")
        largest = max(largest, n)
        union = frozenset().union(*(scope_sets[i] for i in of_var[v]))
        for i in of_var[v]:
            for u in scope_sets[i]:
                if u != v:
                    of_var[u].discard(i)
            del scope_sets[i]
        rest = union - {v}
        if rest:
            scope_sets[next_id] = rest
            for u in rest:
                of_var[u].add(next_id)
            next_id += 1
        del version[v], of_var[v]
        order.append(v)
        for u in rest:  # only the neighbours' tables changed
            version[u] += 1
            heapq.heappush(heap, (size(u), repr(u), version[u], u))
    return order, largest


def minimise(domains: Dict[Hashable, int], factors: Sequence[Factor],
             order: Sequence[Hashable] = None) -> Tuple[Dict[Hashable, int], float]:
    """The assignment (variable -> index into its domain) of least total, and the total.

    order: an elimination order (default: `elimination_order`'s). Variables in no factor
    get index 0."""
    if order is None:
        order, _ = elimination_order(domains, [f[0] for f in factors])
    pool: Dict[int, Factor] = dict(enumerate(factors))
    next_id = len(pool)
    constant = 0.0
    back: List[Tuple[Hashable, Tuple[Hashable, ...], np.ndarray]] = []
    for v in order:
        using = [i for i, (scope, _) in pool.items() if v in scope]
        if not using:
            continue
        union: List[Hashable] = []
        for i in using:
            union.extend(u for u in pool[i][0] if u not in union)
        union.remove(v)
        axes = union + [v]  # v last, to minimise over it
        total = np.zeros([domains[u] for u in axes])  # added into in place: one table
        for i in using:
            scope, table = pool.pop(i)
            perm = sorted(range(len(scope)), key=lambda j: axes.index(scope[j]))
            shape = [1] * len(axes)
            for j in perm:
                shape[axes.index(scope[j])] = table.shape[j]
            total += table.transpose(perm).reshape(shape)
        best = total.argmin(axis=-1)
        back.append((v, tuple(union), best))
        reduced = np.take_along_axis(total, best[..., None], axis=-1)[..., 0]
        if union:
            pool[next_id] = (tuple(union), reduced)
            next_id += 1
        else:
            constant += float(reduced)
    assignment: Dict[Hashable, int] = {}
    for v, rest, best in reversed(back):
        assignment[v] = int(best[tuple(assignment[u] for u in rest)])
    for v in domains:
        assignment.setdefault(v, 0)
    return assignment, constant
