"""The tiling planner: communication-minimal tilings of a training step's dataflow (SoyBean).

- `solve`: the exactly cheapest k-cut tilings of every tensor, over all cuts jointly.
  The problem is a sum of per-op cost tables (matmuls, bias adds, bias gradients), one
  axis per operand's tiling, so SoyBean's DP over BFS levels (its state: the tilings of
  the tensors that a done and a pending op share) is min-plus variable elimination
  (`min_sum`), run vectorised. For one cut (`one_cut`, Equation 3) a layer chain costs
  linear time in depth.
- SoyBean's recursion (Algorithm 1, `recursive_cuts`): the best one cut, then recursively of the
  tile graph, total c = delta_outer + m_outer * c_inner (Theorem 1, generalised to cuts
  into m parts). It is not always optimal (a 3-layer chain on 8 devices: 416 elements
  greedy, 352 joint), so `plan_tiling` solves jointly whenever the tables fit
  (`JOINT_BUDGET`, `JOINT_WORK`: 8 devices on layer chains), and beyond that keeps the
  cheaper of the recursion and a recursion over blocks of cuts each solved jointly.
- `plan_tiling`: any device count, factored into cuts (6 = 2 x 3), every order tried.
  With a DeviceMesh (e.g. hosts x devices), each cut's elements cost the time its links take
  (1 / bandwidth), and every assignment of cuts to links is tried; Theorem 3's rule (the
  least traffic on the slowest links) is then a result, not an assumption.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.errors import TfparError
from tfpar.plan.mesh import DeviceMesh
from tfpar.partition.tiling import min_sum
from tfpar.partition.tiling.dataflow import CAUSES, Dataflow, MatMul, Op, Reduce
from tfpar.partition.tiling.cuts import RED, Cut, Tiling
from tfpar.partition.tiling.tiling_plan import TilingPlan
from tfpar.partition.tiling.op_costs import (_size, _tile_size, op_cut_costs, op_k_cut_cost,
                                             tilings_of)


def one_cut(df: Dataflow, m: int) -> Tuple[Dict[str, Optional[int]], float]:
    """The cheapest one-cut tiling of every matrix (dim or None) and its cost in elements."""
    tilings, cost = solve(df, (m,))
    return {x: t.cuts[0].dim for x, t in tilings.items()}, cost


# What the exact joint search may do before the planner falls back to recursion: the
# largest table it forms (memory: 2e7 float64 = 160 MB) and all tables together (time:
# about a second).
JOINT_BUDGET = 2e7
JOINT_WORK = 1e8
EXACT_LIMITS = (1e8, 5e9)  # `tfpar plan --exact`: 800 MB tables, a minute of work at most


def solve(df: Dataflow, order: Sequence[int], budget: float = float("inf"),
          work: float = float("inf"), link_costs: Optional[Sequence[float]] = None
          ) -> Tuple[Dict[str, Tiling], float]:
    """The cheapest k-cut tilings over all cuts at once, exactly (min-plus variable
    elimination over per-op cost tables; `tfpar.partition.tiling.min_sum`).

    Every matrix ranges over its whole k-cut tilings (up to 3^k), so for many cuts the
    tables outgrow `budget` and this raises `TooLarge`: `plan_tiling` then falls back to
    SoyBean's recursion, one exact cut at a time.

    link_costs: a factor per cut on its elements (e.g. 1 / bandwidth of the cut's links),
    so the search minimises transfer time on a hierarchy rather than elements."""
    if not df.matmuls:
        raise TfparError("the graph has no matmuls: there is nothing for the tiling planner "
                         "to split")
    used = list(dict.fromkeys(x for op in df.ops for x in op.operands))
    by_shape: Dict[Tuple[int, ...], List[Tiling]] = {}
    for shape in {df.matrices[x].shape for x in used}:
        by_shape[shape] = tilings_of(shape, order)
    domains = {x: by_shape[df.matrices[x].shape] for x in used}
    sizes = {x: len(d) for x, d in domains.items()}
    scopes = [list(dict.fromkeys(op.operands)) for op in df.ops]
    elimination, _ = min_sum.elimination_order(sizes, scopes, budget, work)  # before tables
    factors = [cost_table(df, op, domains, order, link_costs) for op in df.ops]
    index, total = min_sum.minimise(sizes, factors, elimination)
    replicate = Tiling(tuple(Cut(None, m) for m in order))
    tilings = {x: domains[x][index[x]] if x in domains else replicate for x in df.matrices}
    return tilings, total


def _to(d, s, want: int, m: int):
    """Vectorised convert_cost from stored tilings `d` (-1: replicated) of tiles of `s`
    elements to the tiling an op's form needs (`want`, -1: whole)."""
    import numpy as np
    if want == -1:
        return np.where(d == -1, 0.0, s * (m - 1))
    return np.where((d == -1) | (d == want), 0.0, s * (1 - 1 / m))


def _from(state, d, s, m: int):
    """Vectorised convert_cost from an op's result (`state`: a dim or RED) to the stored
    tilings `d`."""
    import numpy as np
    if state == RED:
        return s * (m - 1) * np.where(d == -1, 2, 1)
    return np.where(d == state, 0.0, np.where(d == -1, s * (m - 1), s * (1 - 1 / m)))


def cost_table(df: Dataflow, op: Op, domains: Dict[str, List[Tiling]], order: Sequence[int],
                link_costs: Optional[Sequence[float]] = None):
    """op_k_cut_cost for every combination of its operands' tilings, as one array (times
    each cut's link cost)."""
    import numpy as np
    names = op.operands
    transposed = ((op.transpose_a, op.transpose_b, False) if isinstance(op, MatMul)
                  else (False,) * len(names))
    table = np.zeros([len(domains[x]) for x in names])
    weight = 1
    for level, m in enumerate(order):
        dims, sizes = [], []
        for x, flip in zip(names, transposed):
            d = np.array([-1 if t.cuts[level].dim is None else t.cuts[level].dim
                          for t in domains[x]])
            dims.append(np.where(d >= 0, d ^ 1, d) if flip else d)  # as the op uses it
            sizes.append(np.array([_tile_size(df.matrices[x].shape, t, level)
                                   for t in domains[x]]))
        if isinstance(op, MatMul):
            (da, db, dc), (sa, sb, sc) = dims, sizes
            forms = [_to(da, sa, fa, m)[:, None, None] + _to(db, sb, fb, m)[None, :, None]
                     + _from(fc, dc, sc, m)[None, None, :]
                     for fa, fb, fc in ((0, -1, 0), (-1, 1, 1), (1, 0, RED))]
        elif isinstance(op, Reduce):
            (da, dc), (sa, sc) = dims, sizes
            forms = [_to(da, sa, op.axis, m)[:, None] + _from(RED, dc, sc, m)[None, :],
                     _to(da, sa, 1 - op.axis, m)[:, None] + _from(0, dc, sc, m)[None, :],
                     _to(da, sa, -1, m)[:, None] + 0.0 * dc[None, :]]
        else:  # Broadcast
            (da, dc), (sa, _) = dims, sizes
            forms = [np.where(dc[None, :] == 1 - op.axis, _to(da, sa, 0, m)[:, None],
                              _to(da, sa, -1, m)[:, None])]
        link = 1.0 if link_costs is None else link_costs[level]
        table += weight * link * np.minimum.reduce(forms)
        weight *= m
    distinct = list(dict.fromkeys(names))
    if len(distinct) < len(names):  # x^T x and the like: the diagonal over a repeated matrix
        letters = {x: chr(ord("i") + k) for k, x in enumerate(distinct)}
        table = np.einsum("".join(letters[x] for x in names) + "->"
                          + "".join(letters[x] for x in distinct), table)
    return tuple(distinct), np.ascontiguousarray(table)


def cost_of(df: Dataflow, tilings: Dict[str, Tiling], itemsize: int = 4) -> Dict[str, float]:
    """Bytes per step of given k-cut tilings, by cause (Theorem 1's weighting)."""
    out = {c: 0.0 for c in CAUSES}
    for op in df.ops:
        out[op.cause] += op_k_cut_cost(df, op, tilings) * itemsize
    return out


def bytes_by_cut(df: Dataflow, tilings: Dict[str, Tiling], itemsize: int = 4) -> List[float]:
    """Bytes per step crossing each cut's links, outermost cut first."""
    out = [0.0] * len(next(iter(tilings.values())).cuts)
    for op in df.ops:
        for level, c in enumerate(op_cut_costs(df, op, tilings)):
            out[level] += c * itemsize
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


def canonical(df: Dataflow, kind_to_cut: Dict[str, Optional[int]], cuts: Sequence[int]
              ) -> Dict[str, Tiling]:
    """SoyBean's canonical tilings (section 4.1) applied at every cut."""
    return {x: Tiling(tuple(Cut(kind_to_cut[m.kind], p) for p in cuts))
            for x, m in df.matrices.items()}


DATA_PARALLEL = {"weight": None, "input": 0, "activation": 0, "gradient": 0}
MODEL_PARALLEL = {"weight": 0, "input": None, "activation": 1, "gradient": None}


def plan_tiling(df: Dataflow, devices, itemsize: int = 4, time: bool = False,
                iterations: int = 2000, exact_limits: Tuple[float, float] = None
                ) -> TilingPlan:
    """The least-communication k-cut tiling of `df` on `devices`.

    devices: a count (every cut costs its elements: the plan minimises bytes moved) or a
    `tfpar.plan.mesh.DeviceMesh`, e.g. 2 hosts of 4 devices. With a mesh each level is cut in
    prime cuts, each cut's traffic weighted by 1 / its links' bandwidth, and every
    assignment of cuts to levels is tried: the plan minimises transfer time
    (`cut_bandwidths` says which cut went on which links).
    time: simulate the step time on the mesh (compute at its flops, alpha-beta links) and
    minimise it by an MCMC search seeded with data parallelism and the
    communication-optimal plan (FlexFlow); needs a mesh.
    exact_limits: (largest table, all tables) in entries that the exact joint search may
    form; default (JOINT_BUDGET, JOINT_WORK), under a second. `EXACT_LIMITS` (about 1 GB
    and a minute at most) makes e.g. 16 devices on SoyBean's MLP exact.
    """
    limits = exact_limits or (JOINT_BUDGET, JOINT_WORK)
    mesh = devices if isinstance(devices, DeviceMesh) else None
    if mesh is not None:
        devices = mesh.devices
    elif time:
        raise TfparError("time mode simulates the step on a DeviceMesh: pass one as `devices`")
    if not isinstance(devices, int) or devices < 1:
        raise TfparError(f"the number of devices must be a positive int, got {devices!r}")
    if not df.matmuls:
        raise TfparError("the graph has no matmuls: there is nothing for the tiling planner "
                         "to split")
    if mesh is not None:
        # Each prime cut of each level, with the time an element takes on that level's
        # links relative to the fastest. Which cut crosses which links is a choice (a
        # cut's groups can be the hosts or not), so every order is tried; the search
        # then minimises transfer time, and Theorem 3's rule (the cut with the least
        # traffic on the slowest links) comes out of it rather than being imposed.
        fastest = max(lv.bandwidth for lv in mesh.levels)
        cuts = [(c.parts, fastest / c.bandwidth) for c in mesh.prime_cuts()]
        arrangements = sorted(set(itertools.permutations(cuts)))
    else:
        arrangements = [tuple((p, 1.0) for p in order) for order in factorizations(devices)]
    shapes = {m.shape for m in df.matrices.values()}
    if not any(_divides(shape, [p for p, _ in cuts]) for shape in shapes
               for cuts in arrangements):
        largest = max(shapes, key=lambda s: _size(s))
        raise TfparError(f"{devices} devices are more than this graph can use: no tensor "
                         f"divides into {devices} equal tiles (the largest is "
                         f"{'x'.join(map(str, largest))}); plan for fewer devices")
    best = None
    for arrangement in arrangements:
        order = tuple(p for p, _ in arrangement)
        links = tuple(c for _, c in arrangement) if mesh is not None else None
        found = _search(df, order, links, limits)
        if best is None or found[1] < best[1]:
            best = (*found, order, links)
    tilings, _, search, order, links = best
    times = {}
    if time:
        from tfpar.partition.tiling.simulate import Simulator, mcmc
        prime = mesh.prime_cuts()
        order = tuple(c.parts for c in prime)
        fastest = max(c.bandwidth for c in prime) if prime else 1.0
        links = tuple(fastest / c.bandwidth for c in prime)
        dp, mp = canonical(df, DATA_PARALLEL, order), canonical(df, MODEL_PARALLEL, order)
        tilings, _, _ = _search(df, order, links, limits)
        tilings, step = mcmc(df, mesh, [dp, tilings], iterations)
        sim = Simulator(df, mesh, itemsize)
        sim.simulate(tilings)
        busy = sim.busy_by_cause()
        times = dict(step_time_s=step, time_by_cause=busy,
                     data_parallel_time_s=sim.simulate(dp),
                     model_parallel_time_s=sim.simulate(mp))
        search = f"time mode: MCMC ({iterations} steps) from data parallel and the DP plan"
    return TilingPlan(
        devices=devices, cuts=tuple(order), tilings=dict(tilings),
        shapes={x: m.shape for x, m in df.matrices.items()},
        kinds={x: m.kind for x, m in df.matrices.items()},
        bytes_by_cause=cost_of(df, tilings, itemsize) if order else {c: 0.0 for c in CAUSES},
        data_parallel_bytes=_total(df, canonical(df, DATA_PARALLEL, order), itemsize),
        model_parallel_bytes=_total(df, canonical(df, MODEL_PARALLEL, order), itemsize),
        bytes_by_cut=tuple(bytes_by_cut(df, tilings, itemsize)) if order else (),
        mesh=mesh,
        cut_bandwidths=(tuple(fastest / 1e9 / c for c in links) if mesh is not None
                        else None),
        search=search, **times)


def _divides(shape: Sequence[int], order: Sequence[int]) -> bool:
    """Whether cuts into `order` parts can split `shape` into equal tiles, none replicated."""
    if not order:
        return True
    return any(_divides(shape[:d] + (n // order[0],) + shape[d + 1:], order[1:])
               for d, n in enumerate(shape) if n % order[0] == 0)




def _total(df, tilings, itemsize) -> float:
    if not tilings or not next(iter(tilings.values())).cuts:
        return 0.0
    return sum(cost_of(df, tilings, itemsize).values())


EXACT = "exact (joint over all cuts)"
RECURSION = "SoyBean recursion (best cut, then recurse)"


def _search(df: Dataflow, order: Sequence[int], link_costs: Optional[Sequence[float]] = None,
            limits: Tuple[float, float] = (JOINT_BUDGET, JOINT_WORK)
            ) -> Tuple[Dict[str, Tiling], float, str]:
    """The tilings for cuts `order`, their cost and how they were found: exactly when the
    joint tables fit the budgets; else the cheaper of SoyBean's recursion one cut at a
    time and the recursion over blocks of cuts solved jointly (neither dominates).
    link_costs: per cut, a factor on its elements (1 / its links' relative bandwidth)."""
    if not order:
        return {x: Tiling() for x in df.matrices}, 0.0, EXACT
    try:
        return (*solve(df, order, *limits, link_costs), EXACT)
    except min_sum.TooLarge:
        pass
    tilings, total, _ = recursive_cuts(df, order, False, link_costs, limits)
    found = (tilings, total, RECURSION)
    tilings, total, blocks = recursive_cuts(df, order, True, link_costs, limits)
    if max(blocks) > 1 and total < found[1]:
        found = (tilings, total, "recursion over blocks of cuts, each block exact ("
                 + " + ".join(map(str, blocks)) + " cuts)")
    return found


def recursive_cuts(df: Dataflow, order: Sequence[int], joint: bool = False,
            link_costs: Optional[Sequence[float]] = None,
            limits: Tuple[float, float] = (JOINT_BUDGET, JOINT_WORK)
            ) -> Tuple[Dict[str, Tiling], float, List[int]]:
    """Algorithm 1: the best next cut, then recurse on the tile graph; c = delta + m * c'.
    joint: take as many next cuts at once as the joint search's budgets allow (exact
    within the block). Returns the tilings, their cost, and the cuts per block."""
    tilings = {x: Tiling() for x in df.matrices}
    total, weight, i, blocks = 0.0, 1, 0, []
    while i < len(order):
        for size in range(len(order) - i if joint else 1, 0, -1):
            try:
                allowed = limits if size > 1 else (float("inf"),) * 2
                links = None if link_costs is None else link_costs[i:i + size]
                block, delta = solve(df, order[i:i + size], *allowed, links)
                break
            except min_sum.TooLarge:
                continue
        total += weight * delta
        for level in range(size):
            cut = {x: block[x].cuts[level] for x in df.matrices}
            tilings = {x: tilings[x].then(cut[x]) for x in df.matrices}
            df = df.scaled(cut)
            weight *= order[i + level]
        i += size
        blocks.append(size)
    return tilings, total, blocks


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
