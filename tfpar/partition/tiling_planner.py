"""The tiling planner: communication-minimal tilings of a matmul dataflow (SoyBean).

- `one_cut`: the optimal tiling for one cut into m parts (Equation 3), by dynamic
  programming over the matmuls in BFS order: the state is the tiling of every matrix that
  both a done and a pending matmul use (SoyBean's tau_l); for a chain of layers that is a
  few matrices, so the cost is linear in depth and exponential only in width.
- `plan_tiling`: k cuts (Algorithm 1): the best one cut of the graph, then recursively of
  the tile graph, total c = delta_outer + m_outer * c_inner (Theorem 1, generalised to
  cuts into m parts), for any device count factored into cuts (6 = 2 x 3). With a
  hierarchy (hosts x devices), the cuts are ordered to put the first cut, which carries
  the least weighted traffic (Theorem 3), on the slowest links; without one, every order
  of the factors is tried and the cheapest kept.
- `joint_k_cuts`: the same DP over whole k-cut tilings, exact; SoyBean's recursion is not
  always optimal (a 2-layer chain on 4 devices: 192 elements greedy, 168 joint), so the
  planner uses the joint DP while it is small (up to 9 k-cut tilings per matrix: 4
  devices) and the recursion beyond.
- `exhaustive_one_cut`: brute force over every assignment, for tests.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.errors import TfparError
from tfpar.partition.dataflow import CAUSES, Dataflow
from tfpar.partition.tiling import Cut, Tiling, matmul_cost


def options(shape: Sequence[int], m: int) -> List[Optional[int]]:
    """One-cut tilings of a tensor: each evenly divisible dimension, or replication."""
    return [d for d, n in enumerate(shape) if n % m == 0 and n >= m] + [None]


def _cost(df: Dataflow, mm, assign, m: int) -> float:
    a, b, c = df.matrices[mm.a], df.matrices[mm.b], df.matrices[mm.out]
    cost, _ = matmul_cost(assign[mm.a], assign[mm.b], assign[mm.out], a.size, b.size, c.size,
                          m, mm.transpose_a, mm.transpose_b)
    return cost


def _order(df: Dataflow) -> List[int]:
    """Matmul indices in BFS order over shared matrices (SoyBean's levels)."""
    users: Dict[str, List[int]] = {}
    for i, mm in enumerate(df.matmuls):
        for x in (mm.a, mm.b, mm.out):
            users.setdefault(x, []).append(i)
    order, seen = [], set()
    for root in range(len(df.matmuls)):
        if root in seen:
            continue
        queue = [root]
        seen.add(root)
        while queue:
            i = queue.pop(0)
            order.append(i)
            mm = df.matmuls[i]
            for x in (mm.a, mm.b, mm.out):
                for j in users[x]:
                    if j not in seen:
                        seen.add(j)
                        queue.append(j)
    return order


def one_cut(df: Dataflow, m: int) -> Tuple[Dict[str, Optional[int]], float]:
    """The cheapest one-cut tiling of every matrix (dim or None) and its cost in elements."""
    memo: Dict[Tuple, float] = {}

    def cost(mm, assign):
        key = (mm.name, assign[mm.a], assign[mm.b], assign[mm.out])
        if key not in memo:
            memo[key] = _cost(df, mm, assign, m)
        return memo[key]

    return _min_sum(df, lambda x: options(df.matrices[x].shape, m), cost)


def joint_k_cuts(df: Dataflow, order: Sequence[int]) -> Tuple[Dict[str, Tiling], float]:
    """The cheapest k-cut tilings over all cuts at once (exact, unlike the recursion):
    the same DP with a whole k-cut tiling per matrix. Its state space grows as 3^k per
    matrix, so `plan_tiling` uses it only while that stays small."""
    def tilings_of(x):
        out = [Tiling()]
        for m in order:
            out = [t.then(Cut(d, m)) for t in out
                   for d in options(t.tile_shape(df.matrices[x].shape), m)]
        return out

    cache: Dict[Tuple, float] = {}

    def cost(mm, assign):
        key = (mm.name, assign[mm.a], assign[mm.b], assign[mm.out])
        if key not in cache:
            total, weight = 0.0, 1
            for level, m in enumerate(order):
                ta, tb, tc = (assign[x] for x in (mm.a, mm.b, mm.out))
                sizes = [_tile_size(df.matrices[x].shape, assign[x], level)
                         for x in (mm.a, mm.b, mm.out)]
                c, _ = matmul_cost(ta.cuts[level].dim, tb.cuts[level].dim,
                                   tc.cuts[level].dim, *sizes, m, mm.transpose_a,
                                   mm.transpose_b)
                total += weight * c
                weight *= m
            cache[key] = total
        return cache[key]

    assignment, total = _min_sum(df, tilings_of, cost)
    return {x: assignment.get(x) or Tiling(tuple(Cut(None, m) for m in order))
            for x in df.matrices}, total


def _tile_size(shape, tiling: Tiling, level: int) -> float:
    size = 1.0
    for d in Tiling(tiling.cuts[:level]).tile_shape(shape):
        size *= d
    return size


def _min_sum(df: Dataflow, options_of, cost_of_mm) -> Tuple[Dict[str, object], float]:
    """min over assignments of the sum of per-matmul costs, by a frontier DP in BFS order."""
    if not df.matmuls:
        raise TfparError("the graph has no matmuls: there is nothing for the tiling planner "
                         "to split")
    order = _order(df)
    last_use: Dict[str, int] = {}
    for pos, i in enumerate(order):
        mm = df.matmuls[i]
        for x in (mm.a, mm.b, mm.out):
            last_use[x] = pos
    opts = {x: options_of(x) for x in last_use}
    # state: tuple of (matrix, tiling) for live matrices -> (cost, decided assignment)
    states: Dict[Tuple, Tuple[float, Tuple]] = {(): (0.0, ())}
    for pos, i in enumerate(order):
        mm = df.matmuls[i]
        new_states: Dict[Tuple, Tuple[float, Tuple]] = {}
        for live, (cost, decided) in states.items():
            known = dict(live)
            fresh = [x for x in dict.fromkeys((mm.a, mm.b, mm.out)) if x not in known]
            for choice in itertools.product(*(opts[x] for x in fresh)):
                assign = {**known, **dict(zip(fresh, choice))}
                total = cost + cost_of_mm(mm, assign)
                keep = tuple(sorted(((x, t) for x, t in assign.items() if last_use[x] > pos),
                                    key=lambda kv: kv[0]))
                done = decided + tuple((x, t) for x, t in assign.items()
                                       if last_use[x] == pos)
                if keep not in new_states or total < new_states[keep][0]:
                    new_states[keep] = (total, done)
        states = new_states
    cost, decided = min(states.values(), key=lambda st: st[0])
    assignment = dict(decided)
    for x in df.matrices:  # matrices no matmul uses: anything is free
        assignment.setdefault(x, None)
    return assignment, cost


def exhaustive_one_cut(df: Dataflow, m: int) -> float:
    """The least one-cut cost over every assignment (for tests). The sum over matmuls is
    built as one array with an axis per matrix, so 3^13 assignments take a second."""
    import numpy as np
    names = sorted({x for mm in df.matmuls for x in (mm.a, mm.b, mm.out)})
    axis = {x: i for i, x in enumerate(names)}
    opts = {x: options(df.matrices[x].shape, m) for x in names}
    total = np.zeros([len(opts[x]) for x in names])
    for mm in df.matmuls:
        used = list(dict.fromkeys((mm.a, mm.b, mm.out)))
        table = np.zeros([len(opts[x]) for x in used])
        for idx in itertools.product(*(range(len(opts[x])) for x in used)):
            assign = {x: opts[x][i] for x, i in zip(used, idx)}
            table[idx] = _cost(df, mm, assign, m)
        order = sorted(range(len(used)), key=lambda j: axis[used[j]])
        table = table.transpose(order)
        shape = [1] * len(names)
        for j in order:
            shape[axis[used[j]]] = len(opts[used[j]])
        total = total + table.reshape(shape)
    return float(total.min())


def cost_of(df: Dataflow, tilings: Dict[str, Tiling], itemsize: int = 4) -> Dict[str, float]:
    """Bytes per step of given k-cut tilings, by cause (Theorem 1's weighting)."""
    out = {c: 0.0 for c in CAUSES}
    cuts = len(next(iter(tilings.values())).cuts)
    weight = 1
    for level in range(cuts):
        m = next(iter(tilings.values())).cuts[level].parts
        assign = {x: t.cuts[level].dim for x, t in tilings.items()}
        for mm in df.matmuls:
            out[mm.cause] += weight * _cost(df, mm, assign, m) * itemsize
        df = df.scaled({x: t.cuts[level] for x, t in tilings.items()})
        weight *= m
    return out


def factorizations(n: int) -> List[Tuple[int, ...]]:
    """Prime factors of n (each a cut), in every distinct order."""
    if n < 1:
        raise TfparError(f"the number of devices must be at least 1, got {n}")
    primes, k, p = [], n, 2
    while k > 1:
        while k % p == 0:
            primes.append(p)
            k //= p
        p += 1
    return sorted(set(itertools.permutations(primes))) or [()]


@dataclasses.dataclass(frozen=True)
class TilingPlan:
    """What the tiling planner decided, with the data- and model-parallel baselines."""

    devices: int
    cuts: Tuple[int, ...]  # parts per cut, outermost first
    tilings: Dict[str, str]  # matrix -> k-cut tiling, e.g. "RC"
    shapes: Dict[str, Tuple[int, ...]]
    kinds: Dict[str, str]
    bytes_by_cause: Dict[str, float]
    data_parallel_bytes: float
    model_parallel_bytes: float
    hierarchy: Optional[Tuple[Tuple[int, float], ...]] = None  # (parts, link GB/s) per cut
    search: str = ""  # how the tilings were found
    # Time mode (a Machine was given): simulated step times, seconds.
    step_time_s: Optional[float] = None
    data_parallel_time_s: Optional[float] = None
    model_parallel_time_s: Optional[float] = None

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes_by_cause.values())

    @property
    def placement(self) -> Dict[str, str]:
        """Each weight's tiling: where its pieces live (tile i of the tiling on device i)."""
        return {x: t for x, t in self.tilings.items() if self.kinds[x] == "weight"}

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(dataclasses.asdict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "TilingPlan":
        d = json.loads(text)
        d["cuts"] = tuple(d["cuts"])
        d["shapes"] = {k: tuple(v) for k, v in d["shapes"].items()}
        if d.get("hierarchy"):
            d["hierarchy"] = tuple(tuple(h) for h in d["hierarchy"])
        return cls(**d)

    def table(self) -> str:
        from tfpar.analysis import format_table
        rows = [("tensor", "kind", "shape", "tiling")]
        for x in sorted(self.tilings, key=lambda n: (self.kinds[n] != "weight", n)):
            rows.append((x, self.kinds[x], "x".join(map(str, self.shapes[x])), self.tilings[x]))
        mb = 1e6
        lines = [f"tfpar tiling plan: {self.devices} devices as cuts "
                 f"{' x '.join(map(str, self.cuts)) or '-'} (outermost first); search: "
                 f"{self.search}",
                 format_table(rows),
                 "bytes per step: " + ", ".join(f"{c} {b / mb:.3f} MB"
                                                for c, b in self.bytes_by_cause.items())
                 + f"; total {self.total_bytes / mb:.3f} MB",
                 f"for comparison: data parallel {self.data_parallel_bytes / mb:.3f} MB, "
                 f"model parallel {self.model_parallel_bytes / mb:.3f} MB"]
        if self.step_time_s is not None:
            lines.append(f"simulated step time: {self.step_time_s * 1e3:.3f} ms (data parallel "
                         f"{self.data_parallel_time_s * 1e3:.3f} ms, model parallel "
                         f"{self.model_parallel_time_s * 1e3:.3f} ms)")
        return "\n".join(lines)


def canonical(df: Dataflow, kind_to_cut: Dict[str, Optional[int]], cuts: Sequence[int]
              ) -> Dict[str, Tiling]:
    """SoyBean's canonical tilings (section 4.1) applied at every cut."""
    return {x: Tiling(tuple(Cut(kind_to_cut[m.kind], p) for p in cuts))
            for x, m in df.matrices.items()}


DATA_PARALLEL = {"weight": None, "input": 0, "activation": 0, "gradient": 0}
MODEL_PARALLEL = {"weight": 0, "input": None, "activation": 1, "gradient": None}


def plan_tiling(df: Dataflow, devices: int, hierarchy: Optional[Sequence[Tuple[int, float]]]
                = None, itemsize: int = 4, machine=None, iterations: int = 2000) -> TilingPlan:
    """The least-communication k-cut tiling of `df` on `devices` devices.

    hierarchy: optional ((parts, link bandwidth), ...) from the outside in, e.g.
    ((2, 1.25), (8, 25.0)) for 2 hosts of 8 devices; its product must be `devices`. Its
    levels are cut outermost-slowest (Theorem 3), each level in prime cuts.
    machine: a `tfpar.partition.simulate.Machine` turns on time mode: the step time is
    simulated (compute estimates, alpha-beta links) and an MCMC search seeded with data
    parallelism and the communication-optimal plan minimises it.
    """
    if not isinstance(devices, int) or devices < 1:
        raise TfparError(f"the number of devices must be a positive int, got {devices!r}")
    largest = max((d for m in df.matrices.values() for d in m.shape), default=0)
    if not df.matmuls:
        raise TfparError("the graph has no matmuls: there is nothing for the tiling planner "
                         "to split")
    if devices > largest:
        raise TfparError(f"{devices} devices cannot split any tensor of this graph: its "
                         f"largest dimension is {largest}")
    if hierarchy:
        prod = 1
        for parts, _ in hierarchy:
            prod *= parts
        if prod != devices:
            raise TfparError(f"the hierarchy {list(hierarchy)} has {prod} devices, not {devices}")
        orders = [tuple(p for parts, _ in hierarchy for p in factorizations(parts)[0])]
    else:
        orders = factorizations(devices)
    best = None
    for order in orders:
        exact = _joint_is_small(df, order)
        tilings, total = joint_k_cuts(df, order) if exact else _k_cuts(df, order)
        if best is None or total < best[1]:
            best = (tilings, total, order, exact)
    tilings, _, order, exact = best
    times = {}
    search = ("exact (joint over all cuts)" if exact or not order
              else "SoyBean recursion (best cut, then recurse)")
    if machine is not None:
        from tfpar.partition.simulate import Simulator, mcmc
        if machine.devices != devices:
            raise TfparError(f"the machine has {machine.devices} devices, not {devices}")
        order = tuple(p for p, _, _ in machine.cuts)
        dp, mp = canonical(df, DATA_PARALLEL, order), canonical(df, MODEL_PARALLEL, order)
        if tuple(c.parts for c in next(iter(tilings.values())).cuts) != order:
            tilings, _ = _k_cuts(df, order)
        tilings, step = mcmc(df, machine, [dp, tilings], iterations)
        sim = Simulator(df, machine, itemsize)
        times = dict(step_time_s=step, data_parallel_time_s=sim.simulate(dp),
                     model_parallel_time_s=sim.simulate(mp))
        search = f"time mode: MCMC ({iterations} steps) from data parallel and the DP plan"
    return TilingPlan(
        devices=devices, cuts=tuple(order), tilings={x: str(t) for x, t in tilings.items()},
        shapes={x: m.shape for x, m in df.matrices.items()},
        kinds={x: m.kind for x, m in df.matrices.items()},
        bytes_by_cause=cost_of(df, tilings, itemsize) if order else {c: 0.0 for c in CAUSES},
        data_parallel_bytes=_total(df, canonical(df, DATA_PARALLEL, order), itemsize),
        model_parallel_bytes=_total(df, canonical(df, MODEL_PARALLEL, order), itemsize),
        hierarchy=tuple(tuple(h) for h in hierarchy) if hierarchy else None,
        search=search, **times)


JOINT_LIMIT = 9  # k-cut tilings per matrix up to which the exact joint DP runs


def _joint_is_small(df: Dataflow, order: Sequence[int]) -> bool:
    n = 1
    for _ in order:
        n *= 3
    return n <= JOINT_LIMIT


def _total(df, tilings, itemsize) -> float:
    if not tilings or not next(iter(tilings.values())).cuts:
        return 0.0
    return sum(cost_of(df, tilings, itemsize).values())


def _k_cuts(df: Dataflow, order: Sequence[int]) -> Tuple[Dict[str, Tiling], float]:
    """Algorithm 1: best one cut, then recurse on the tile graph; c = delta + m * c'."""
    tilings = {x: Tiling() for x in df.matrices}
    total, weight = 0.0, 1
    for m in order:
        assign, delta = one_cut(df, m)
        total += weight * delta
        cut = {x: Cut(assign[x], m) for x in df.matrices}
        tilings = {x: tilings[x].then(cut[x]) for x in df.matrices}
        df = df.scaled(cut)
        weight *= m
    return tilings, total


def section22_bytes(df: Dataflow, groups: int, per_group: int, itemsize: int = 4) -> float:
    """SoyBean section 2.2's counting convention (a parameter-server view): data
    parallelism across `groups` moves the parameters twice per group (push gradients,
    pull values); model parallelism inside a group of `per_group` moves the group's share
    of the forward activations twice per device (activations forward, their gradients
    backward): [groups > 1] 2 P groups + [per_group > 1] 2 A per_group."""
    params = sum(m.size for m in df.matrices.values() if m.kind == "weight") * itemsize
    acts = sum(m.size for m in df.matrices.values() if m.kind == "activation") * itemsize
    return ((2 * params * groups if groups > 1 else 0)
            + (2 * acts * per_group if per_group > 1 else 0))


def best_group_hybrid(df: Dataflow, devices: int, itemsize: int = 4) -> Tuple[int, int, float]:
    """The cheapest (groups, per_group) split under section 2.2's convention."""
    splits = [(g, devices // g) for g in range(1, devices + 1) if devices % g == 0]
    return min(((g, m, section22_bytes(df, g, m, itemsize)) for g, m in splits),
               key=lambda s: s[2])
