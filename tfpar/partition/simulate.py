"""Time-based planning (FlexFlow's idea): simulate a strategy's step time, search with MCMC.

A strategy gives every matrix a k-cut tiling. Each matmul becomes two tasks, in the
dataflow's topological order: a transfer (its tiling conversions: alpha per message plus
bytes per device over the cut's link bandwidth, per cut) on the network, then the
computation (2abc/N flops on each device) on the devices; a task starts when its inputs'
producers have finished and its resource is free. The step time is the last finish.

Delta simulation: changing one matrix's tiling changes only the matmuls that use it, so
the schedule is recomputed from the first of those in the task order; everything before
it is reused. It equals a full simulation (a test checks random changes).

Search: Markov chain Monte Carlo (Metropolis-Hastings), as FlexFlow, seeded with data
parallelism and the communication-optimal DP plan. An ILP would need the makespan
linearised (max over paths); MCMC uses the simulator as it is and keeps improving with
more iterations.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.partition.dataflow import CAUSES, Dataflow
from tfpar.partition.tiling import Tiling, matmul_cost
from tfpar.partition.tiling_planner import tilings_of


@dataclasses.dataclass(frozen=True)
class Machine:
    """flops per device per second; per cut (outermost first): (parts, bandwidth B/s, alpha s)."""

    flops: float = 1e12
    cuts: Tuple[Tuple[int, float, float], ...] = ((2, 10e9, 5e-6),)

    @property
    def devices(self) -> int:
        n = 1
        for parts, _, _ in self.cuts:
            n *= parts
        return n


class Simulator:
    """Step time of a strategy on a machine, with delta updates."""

    def __init__(self, df: Dataflow, machine: Machine, itemsize: int = 4):
        self.df, self.machine, self.itemsize = df, machine, itemsize
        self.order = _topological(df)
        self.users: Dict[str, List[int]] = {}
        for pos, i in enumerate(self.order):
            mm = df.matmuls[i]
            for x in (mm.a, mm.b, mm.out):
                self.users.setdefault(x, []).append(pos)
        producer = {}
        self.deps: List[List[int]] = []
        for pos, i in enumerate(self.order):
            mm = df.matmuls[i]
            self.deps.append([producer[x] for x in (mm.a, mm.b) if x in producer])
            producer.setdefault(mm.out, pos)
        self.strategy: Dict[str, Tiling] = {}
        self._comm: List[float] = []
        self._comp: List[float] = []
        self._finish: List[Tuple[float, float, float]] = []  # (comm end, comp end, link free)

    # -- costs of one matmul -----------------------------------------------------------------
    def _durations(self, pos: int, strategy: Dict[str, Tiling]) -> Tuple[float, float]:
        mm = self.df.matmuls[self.order[pos]]
        mats = [self.df.matrices[x] for x in (mm.a, mm.b, mm.out)]
        comm = 0.0
        groups = 1
        for level, (parts, bandwidth, alpha) in enumerate(self.machine.cuts):
            tiles = [strategy[x] for x in (mm.a, mm.b, mm.out)]
            sizes = [_size(Tiling(t.cuts[:level]).tile_shape(m.shape)) for t, m in zip(tiles, mats)]
            moved, _ = matmul_cost(*(t.cuts[level].dim for t in tiles), *sizes, parts,
                                   mm.transpose_a, mm.transpose_b)
            if moved:
                per_device = moved * groups * self.itemsize / self.machine.devices
                comm += alpha * (parts - 1) + per_device / bandwidth
            groups *= parts
        a, b = mats[0].shape, mats[1].shape
        inner = a[0] if mm.transpose_a else a[1]
        flops = 2.0 * mats[2].size * inner / self.machine.devices
        return comm, flops / self.machine.flops

    # -- simulation ----------------------------------------------------------------------------
    def simulate(self, strategy: Dict[str, Tiling]) -> float:
        """Full simulation."""
        self.strategy = dict(strategy)
        durations = [self._durations(p, self.strategy) for p in range(len(self.order))]
        self._comm = [d[0] for d in durations]
        self._comp = [d[1] for d in durations]
        self._finish = []
        self._schedule_from(0)
        return self.step_time

    def change(self, matrix: str, tiling: Tiling) -> float:
        """Delta simulation: one matrix's tiling changes; returns the new step time."""
        self.strategy[matrix] = tiling
        affected = self.users.get(matrix, [])
        for p in affected:
            self._comm[p], self._comp[p] = self._durations(p, self.strategy)
        if affected:
            del self._finish[min(affected):]
            self._schedule_from(min(affected))
        return self.step_time

    def _schedule_from(self, start: int):
        link_free = self._finish[start - 1][2] if start else 0.0
        device_free = self._finish[start - 1][1] if start else 0.0
        for p in range(start, len(self.order)):
            ready = max((self._finish[d][1] for d in self.deps[p]), default=0.0)
            comm_start = max(ready, link_free)
            comm_end = comm_start + self._comm[p]
            link_free = comm_end
            comp_end = max(comm_end, device_free) + self._comp[p]
            device_free = comp_end
            self._finish.append((comm_end, comp_end, link_free))

    def busy_by_cause(self) -> Dict[str, float]:
        """Of the last simulation: seconds of transfers per cause (forward, backward_data,
        backward_weight) and seconds of compute per device ("compute")."""
        out = {c: 0.0 for c in CAUSES}
        for pos, comm in enumerate(self._comm):
            out[self.df.matmuls[self.order[pos]].cause] += comm
        out["compute"] = sum(self._comp)
        return out

    @property
    def step_time(self) -> float:
        return max((f[1] for f in self._finish), default=0.0)


def mcmc(df: Dataflow, machine: Machine, seeds: Sequence[Dict[str, Tiling]],
         iterations: int = 2000, beta: Optional[float] = None, seed: int = 0
         ) -> Tuple[Dict[str, Tiling], float]:
    """Metropolis-Hastings over strategies from each seed; the best strategy seen."""
    parts = [p for p, _, _ in machine.cuts]
    names = sorted({x for mm in df.matmuls for x in (mm.a, mm.b, mm.out)})
    choices = {x: tilings_of(df.matrices[x].shape, parts) for x in names}
    rng = random.Random(seed)
    sim = Simulator(df, machine)
    best, best_time = None, math.inf
    for start in seeds:
        current = sim.simulate({**{x: choices[x][-1] for x in df.matrices}, **start})
        if current < best_time:
            best, best_time = dict(sim.strategy), current
        temperature = beta if beta is not None else 20.0 / max(current, 1e-12)
        for _ in range(iterations // max(len(seeds), 1)):
            x = rng.choice(names)
            old = sim.strategy[x]
            proposed = sim.change(x, rng.choice(choices[x]))
            if proposed <= current or rng.random() < math.exp(-temperature * (proposed - current)):
                current = proposed
                if current < best_time:
                    best, best_time = dict(sim.strategy), current
            else:
                sim.change(x, old)
    return best, best_time


def _size(shape) -> float:
    n = 1.0
    for d in shape:
        n *= d
    return n


def _topological(df: Dataflow) -> List[int]:
    """Matmuls in an order where each comes after the producers of its inputs."""
    produced_by = {mm.out: i for i, mm in enumerate(df.matmuls)}
    order, seen = [], set()

    def visit(i, stack=()):
        if i in seen or i in stack:
            return
        mm = df.matmuls[i]
        for x in (mm.a, mm.b):
            j = produced_by.get(x)
            if j is not None and j != i:
                visit(j, stack + (i,))
        seen.add(i)
        order.append(i)

    for i in range(len(df.matmuls)):
        visit(i)
    return order
