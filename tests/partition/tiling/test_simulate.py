"""Time-based planning: the simulator's delta updates and the MCMC search."""
import itertools
import random

import pytest

from tfpar.partition.tiling.dataflow import mlp
from tfpar.plan.mesh import DeviceMesh, MeshLevel
from tfpar.partition.tiling.simulate import Simulator, mcmc
from tfpar.partition.tiling.cuts import Tiling
from tfpar.partition.tiling.op_costs import tilings_of
from tfpar.partition.tiling.planner import DATA_PARALLEL, canonical, plan_tiling

MACHINE4 = DeviceMesh((MeshLevel(2, 1e9, 2e-5), MeshLevel(2, 10e9, 5e-6)), flops=5e9)


def test_delta_simulation_equals_full_simulation_on_random_changes():
    rng = random.Random(0)
    for df in (mlp(64, [128, 256, 64]), mlp(32, [64] * 5), mlp(32, [64] * 4, bias=True)):
        parts = [c.parts for c in MACHINE4.levels]
        names = sorted(df.matrices)
        choices = {x: tilings_of(df.matrices[x].shape, parts) for x in names}
        delta, full = Simulator(df, MACHINE4), Simulator(df, MACHINE4)
        delta.simulate({x: rng.choice(choices[x]) for x in names})
        for _ in range(200):
            x = rng.choice(names)
            t = delta.change(x, rng.choice(choices[x]))
            assert t == pytest.approx(full.simulate(delta.strategy), rel=1e-12)


def test_more_communication_or_compute_takes_longer():
    df = mlp(64, [128, 128])
    sim = Simulator(df, MACHINE4)
    dp = canonical(df, DATA_PARALLEL, [2, 2])
    slow_net = Simulator(df, DeviceMesh(((2, 1e8, 2e-5), (2, 1e9, 5e-6)), 5e9))
    assert slow_net.simulate(dp) > sim.simulate(dp)


def test_mcmc_finds_the_exhaustive_optimum_on_small_graphs():
    for df, machine in ((mlp(16, [32, 8]), DeviceMesh(((2, 1e8, 1e-5),), 1e9)),
                        (mlp(8, [64, 64]), DeviceMesh(((2, 1e8, 1e-5),), 1e9)),
                        (mlp(16, [32, 16]), MACHINE4)):
        parts = [c.parts for c in machine.levels]
        names = sorted({x for mm in df.matmuls for x in (mm.a, mm.b, mm.out)})
        sim = Simulator(df, machine)
        every = itertools.product(*(tilings_of(df.matrices[x].shape, parts) for x in names))
        exhaustive = min(sim.simulate(dict(zip(names, combo))) for combo in every)
        comm_optimal = plan_tiling(df, machine.devices).tilings
        seeds = [canonical(df, DATA_PARALLEL, parts), comm_optimal]
        _, found = mcmc(df, machine, seeds, iterations=3000)
        assert found == pytest.approx(exhaustive, rel=1e-9)


def test_time_mode_plan_is_no_slower_than_its_seeds():
    df = mlp(64, [256, 256, 256])
    plan = plan_tiling(df, MACHINE4, time=True, iterations=1000)
    assert plan.search.startswith("time mode")
    assert plan.step_time_s <= plan.data_parallel_time_s + 1e-12
    busy = plan.time_by_cause
    assert set(busy) == {"forward", "backward_data", "backward_weight", "compute"}
    assert busy["compute"] > 0 and plan.step_time_s >= busy["compute"] - 1e-15
    comm = plan_tiling(df, 4)
    sim = Simulator(df, MACHINE4)
    assert plan.step_time_s <= sim.simulate(comm.tilings) + 1e-12
    assert "simulated step time" in plan.table()
