"""Time-based planning (FlexFlow's idea): simulate a strategy's step time, search with MCMC.

A strategy gives every matrix a k-cut tiling. Each op (matmul, bias add, bias gradient)
becomes two tasks, in the dataflow's topological order: a transfer (its tiling
conversions: alpha per message plus bytes per device over the cut's link bandwidth, per
cut) on the network, then the computation (2abc/N flops for a matmul, one per element
otherwise, on each device) on the devices; a task starts when its inputs'
producers have finished and its resource is free. The step time is the last finish.

Delta simulation: changing one matrix's tiling changes only the ops that use it, so
the schedule is recomputed from the first of those in the task order; everything before
it is reused. It equals a full simulation (a test checks random changes).

Search: Markov chain Monte Carlo (Metropolis-Hastings), as FlexFlow, seeded with data
parallelism and the communication-optimal DP plan. An ILP would need the makespan
linearised (max over paths); MCMC uses the simulator as it is and keeps improving with
more iterations.
"""
from __future__ import annotations

import math
import random
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.plan.mesh import DeviceMesh
from tfpar.partition.tiling.dataflow import CAUSES, Dataflow
from tfpar.partition.tiling.cuts import Tiling
from tfpar.partition.tiling.op_costs import op_cut_costs, tilings_of


class Simulator:
    """Step time of a strategy on a device mesh (its prime cuts are the tilings' cuts, its
    flops each device's speed), with delta updates."""

    def __init__(self, df: Dataflow, mesh: DeviceMesh, itemsize: int = 4):
        self.df, self.mesh, self.itemsize = df, mesh, itemsize
        self.cuts = mesh.prime_cuts()
        self.order = _topological(df)
        self.users: Dict[str, List[int]] = {}
        for pos, i in enumerate(self.order):
            for x in df.ops[i].operands:
                self.users.setdefault(x, []).append(pos)
        producer = {}
        self.deps: List[List[int]] = []
        for pos, i in enumerate(self.order):
            op = df.ops[i]
            self.deps.append([producer[x] for x in op.operands[:-1] if x in producer])
            if df.matrices[op.operands[-1]].kind != "weight":  # see _topological
                producer.setdefault(op.operands[-1], pos)
        self.strategy: Dict[str, Tiling] = {}
        self._comm: List[float] = []
        self._comp: List[float] = []
        self._finish: List[Tuple[float, float, float]] = []  # (comm end, comp end, link free)

    # -- costs of one op -----------------------------------------------------------------------
    def _durations(self, pos: int, strategy: Dict[str, Tiling]) -> Tuple[float, float]:
        op = self.df.ops[self.order[pos]]
        moved_by_cut = op_cut_costs(self.df, op, {x: strategy[x] for x in op.operands})
        comm = 0.0
        devices = self.mesh.devices
        for moved, cut in zip(moved_by_cut, self.cuts):
            if moved:
                per_device = moved * self.itemsize / devices
                comm += cut.latency * (cut.parts - 1) + per_device / cut.bandwidth
        return comm, self.df.flops(op) / devices / self.mesh.flops

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
            out[self.df.ops[self.order[pos]].cause] += comm
        out["compute"] = sum(self._comp)
        return out

    @property
    def step_time(self) -> float:
        return max((f[1] for f in self._finish), default=0.0)


def mcmc(df: Dataflow, mesh: DeviceMesh, seeds: Sequence[Dict[str, Tiling]],
         iterations: int = 2000, beta: Optional[float] = None, seed: int = 0
         ) -> Tuple[Dict[str, Tiling], float]:
    """Metropolis-Hastings over strategies from each seed; the best strategy seen."""
    parts = [c.parts for c in mesh.prime_cuts()]
    names = sorted({x for op in df.ops for x in op.operands})
    choices = {x: tilings_of(df.matrices[x].shape, parts) for x in names}
    rng = random.Random(seed)
    sim = Simulator(df, mesh)
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


def _topological(df: Dataflow) -> List[int]:
    """Ops in an order where each comes after the producers of its inputs (an op's last
    operand is what it writes). A weight's gradient, written into the weight's tiling, is
    for the next step: the forward ops that read the weight do not wait for it."""
    produced_by = {op.operands[-1]: i for i, op in enumerate(df.ops)
                   if df.matrices[op.operands[-1]].kind != "weight"}
    order, seen = [], set()

    def visit(i, stack=()):
        if i in seen or i in stack:
            return
        for x in df.ops[i].operands[:-1]:
            j = produced_by.get(x)
            if j is not None and j != i:
                visit(j, stack + (i,))
        seen.add(i)
        order.append(i)

    for i in range(len(df.ops)):
        visit(i)
    return order
