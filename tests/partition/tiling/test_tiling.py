"""The tiling planner against SoyBean's numbers, its theorems, and brute force."""
import itertools
import random

import numpy as np
import pytest

import tfpar
from tfpar.plan import Plan
from tfpar.plan.mesh import DeviceMesh, MeshLevel
from tfpar.partition.tiling.dataflow import mlp
from tfpar.partition.tiling.cuts import Cut, Tiling, convert_cost, distinct_tilings, matmul_cost
from tfpar.partition.tiling import min_sum
from tfpar.partition.tiling.dataflow import Dataflow
from tfpar.partition.tiling.planner import (DATA_PARALLEL, EXACT_LIMITS, MODEL_PARALLEL,
                                            TilingPlan, cost_table, recursive_cuts,
                                            best_group_hybrid, canonical, cost_of, one_cut,
                                            plan_tiling, section22_bytes, solve)
from tests.partition.tiling.tiling_enumeration import brute_force, chain_optimum, tables

MB = 1e6
SOYBEAN_MLP = mlp(400, [300] * 6)  # 5 layers of 300, batch 400


def test_section_2_2_reference_numbers():
    assert section22_bytes(SOYBEAN_MLP, 16, 1) == pytest.approx(57.6 * MB)  # data parallel
    assert section22_bytes(SOYBEAN_MLP, 1, 16) == pytest.approx(76.8 * MB)  # model parallel
    assert section22_bytes(SOYBEAN_MLP, 4, 4) == pytest.approx(33.6 * MB)  # 4 x 4 hybrid
    groups, per_group, cost = best_group_hybrid(SOYBEAN_MLP, 16)
    assert cost <= 33.6 * MB + 1 and (groups, per_group) == (4, 4)


def test_swapped_shapes_favour_model_parallelism():
    swapped = mlp(300, [400] * 6)
    assert section22_bytes(swapped, 16, 1) == pytest.approx(102.4 * MB)
    assert section22_bytes(swapped, 1, 16) == pytest.approx(76.8 * MB)
    assert best_group_hybrid(swapped, 16)[2] < section22_bytes(swapped, 16, 1)
    # Under the conversion model as well: with width > batch, splitting weights wins.
    plan = plan_tiling(swapped, 2)
    assert plan.model_parallel_bytes < plan.data_parallel_bytes
    original = plan_tiling(SOYBEAN_MLP, 2)
    assert original.data_parallel_bytes < original.model_parallel_bytes


def test_conversion_model_matches_the_digest_on_two_devices():
    s = 100.0
    assert convert_cost(0, 1, s, 2) == s / 2 and convert_cost(0, None, s, 2) == s
    assert convert_cost(None, 0, s, 2) == 0 and convert_cost("red", 0, s, 2) == s
    assert convert_cost("red", None, s, 2) == 2 * s
    # Digest check: data parallel costs 2|W| per layer (dW: C x R -> red, then red -> r);
    # model parallel about 2|activations|; ratio 0.75 as in section 2.2.
    per_cut = {c: b / 4 for c, b in cost_of(SOYBEAN_MLP, canonical(SOYBEAN_MLP, DATA_PARALLEL,
                                                                       [2]), 1).items()}
    assert per_cut["backward_weight"] == pytest.approx(2 * 5 * 300 * 300 / 4)
    assert matmul_cost(0, None, 0, 10, 10, 10, 2) == (0, "R x r -> R")
    assert matmul_cost(None, 1, 1, 10, 10, 10, 2) == (0, "r x C -> C")
    # C x R: partial sums, then red -> r (2S) beats moving both operands (25).
    assert matmul_cost(1, 0, None, 10, 10, 10, 2) == (20, "C x R -> red")
    # A transposed operand's stored rows are the product's columns.
    assert matmul_cost(0, 0, None, 10, 10, 10, 2, transpose_a=True)[1] == "C x R -> red"


def test_bias_add_and_bias_gradient_costs():
    from tfpar.partition.tiling.cuts import broadcast_cost, reduce_cost
    s = 100.0
    # dY split over the batch rows (data parallel): partial sums, all-reduced into a
    # replicated bias (2S(m-1)), or reduce-scattered into a split one (S(m-1)).
    assert reduce_cost(0, None, 1000, s, 4) == (2 * s * 3, "split reduced axis -> red")
    assert reduce_cost(0, 0, 1000, s, 4)[0] == s * 3
    # dY split over columns (model parallel): each sums its own columns, nothing moves.
    assert reduce_cost(1, 0, 1000, s, 4) == (0, "split kept axis -> split")
    assert reduce_cost(None, 0, 1000, s, 4)[0] == 0
    # The bias add: rows split or replicated need the whole bias; columns split need the
    # matching part.
    assert broadcast_cost(None, 0, s, 4) == 0 and broadcast_cost(0, 0, s, 4) == s * 3
    assert broadcast_cost(0, 1, s, 4) == 0 and broadcast_cost(None, 1, s, 4) == 0
    # Data parallelism all-reduces bias gradients too: 2 |b| (m - 1) per cut.
    plain, biased = mlp(16, [8, 12, 4]), mlp(16, [8, 12, 4], bias=True)
    dp = [sum(cost_of(df, canonical(df, DATA_PARALLEL, [2]), 1).values())
          for df in (plain, biased)]
    assert dp[1] - dp[0] == 2 * (12 + 4)


def test_the_planner_beats_or_equals_the_canonical_tilings():
    for n in (2, 4, 8, 16):
        plan = plan_tiling(SOYBEAN_MLP, n)
        assert plan.total_bytes <= plan.data_parallel_bytes + 1e-6
        assert plan.total_bytes <= plan.model_parallel_bytes + 1e-6
    # SoyBean's 4-device hybrid (data parallel across 2 groups, model parallel inside).
    hybrid = {x: Tiling((Cut({"weight": None}.get(m.kind, 0)),
                         Cut({"weight": 0, "activation": 1}.get(m.kind, None))))
              for x, m in SOYBEAN_MLP.matrices.items()}
    assert plan_tiling(SOYBEAN_MLP, 4).total_bytes <= sum(cost_of(SOYBEAN_MLP, hybrid).values())
    # Section 2.2's 16 devices: the planner's own choice against the 4 x 4 hybrid (data
    # parallel over 4 groups, model parallel inside), costed both ways.
    hybrid16 = {x: Tiling(tuple(Cut({"weight": None}.get(m.kind, 0)) for _ in range(2))
                          + tuple(Cut({"weight": 0, "activation": 1}.get(m.kind, None))
                                  for _ in range(2)))
                for x, m in SOYBEAN_MLP.matrices.items()}
    plan16 = plan_tiling(SOYBEAN_MLP, 16)
    assert plan16.total_bytes <= sum(cost_of(SOYBEAN_MLP, hybrid16).values())
    assert plan16.total_bytes <= 33.6 * MB
    # With room for the exact search (tfpar plan --exact), 16 devices are exact too.
    exact16 = plan_tiling(SOYBEAN_MLP, 16, exact_limits=EXACT_LIMITS)
    assert exact16.search == "exact (joint over all cuts)" != plan16.search
    assert exact16.total_bytes <= plan16.total_bytes


def test_flattening_counts_distinct_tilings():
    for k in range(1, 6):
        assert distinct_tilings(k) == (k + 1) * (k + 2) // 2
    assert {str(t) for t in map(Tiling.parse, ["RC", "CR"])} == {"RC", "CR"}
    assert Tiling.parse("RC").flattened() == Tiling.parse("CR").flattened()


def test_theorem_1_accumulation():
    """c_k = sum_i 2^(k-i) delta_i: the plan's total is the weighted sum of its cuts."""
    plan = plan_tiling(SOYBEAN_MLP, 8)
    df, weight, total = SOYBEAN_MLP, 1, 0.0
    tilings = plan.tilings
    for level, m in enumerate(plan.cuts):
        assign = {x: t.cuts[level].dim for x, t in tilings.items()}
        delta = sum(matmul_cost(assign[mm.a], assign[mm.b], assign[mm.out],
                                *(df.matrices[x].size for x in (mm.a, mm.b, mm.out)), m,
                                mm.transpose_a, mm.transpose_b)[0] for mm in df.matmuls)
        total += weight * delta
        df = df.scaled({x: t.cuts[level] for x, t in tilings.items()})
        weight *= m
    assert total * 4 == pytest.approx(plan.total_bytes)


def _chains():
    """24 chains of 1-4 layers, assorted shapes; every other one with biases."""
    rng = random.Random(0)
    sizes = [2, 4, 6, 8, 12, 16, 24, 32]
    out = []
    for layers in (1, 2, 3, 4):
        for i in range(6):
            out.append(mlp(rng.choice(sizes), [rng.choice(sizes) for _ in range(layers + 1)],
                           bias=bool(i % 2)))
    return out


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_planner_equals_exhaustive_enumeration(n):
    """Every chain of 1-4 layers: the planner's k-cut tilings cost exactly the least any
    assignment of k-cut tilings costs, found by listing them all where that fits (every
    chain at N=2) and layer by layer where it does not (4 layers at N=8: 27^13)."""
    order = {2: (2,), 4: (2, 2), 8: (2, 2, 2)}[n]
    listed = 0
    for df in _chains():
        plan = plan_tiling(df, n)
        assert plan.search == "exact (joint over all cuts)" and plan.cuts == order
        tabled = tables(df, order)
        best = chain_optimum(df, order, tabled)
        everything = brute_force(df, order, tabled=tabled)
        if everything is not None:
            assert everything == pytest.approx(best, rel=1e-12, abs=1e-9)
            listed += 1
        assert plan.total_bytes / 4 == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert listed >= {2: 18, 4: 9, 8: 4}[n], listed


def test_each_cut_of_the_recursion_is_optimal():
    """SoyBean's Equation 3 DP: every cut of the recursion is the cheapest one cut."""
    for df in _chains():
        current = df
        for _ in range(3):
            assign, cost = one_cut(current, 2)
            tabled = tables(current, (2,))
            best = brute_force(current, (2,), tabled=tabled)
            if best is None:  # 3^17 assignments: 4 layers with biases
                best = chain_optimum(current, (2,), tabled)
            assert cost == pytest.approx(best, abs=1e-9)
            current = current.scaled({x: Cut(assign[x], 2) for x in current.matrices})


def test_the_recursion_is_not_always_optimal_and_joint_never_worse():
    greedy_worse = 0
    for df in _chains():
        for order in ((2, 2), (2, 2, 2)):
            _, joint = solve(df, order)
            _, greedy, _ = recursive_cuts(df, order)
            assert joint <= greedy + 1e-9
            greedy_worse += greedy > joint + 1e-9
    assert greedy_worse >= 3
    # The README's example: batch 6, widths 32-4-4-16, 8 devices.
    example = mlp(6, [32, 4, 4, 16])
    assert solve(example, (2, 2, 2))[1] == 352 and recursive_cuts(example, (2, 2, 2))[1] == 416
    # Beyond the joint search's budget (16 and 64 devices): blocks of cuts solved jointly,
    # kept only when they beat the plain recursion.
    for df, n in ((SOYBEAN_MLP, 16), (mlp(64, [256] * 4), 64)):
        plan = plan_tiling(df, n)
        _, greedy, _ = recursive_cuts(df, plan.cuts)
        assert plan.total_bytes <= greedy * 4 + 1e-6
        assert plan.search.startswith("recursion over blocks of cuts"), plan.search
        assert plan.total_bytes < greedy * 4


def test_vectorised_cost_tables_equal_the_scalar_rule():
    """Transposed operands, a matrix used twice (x^T x), bias adds and reductions over
    either axis included."""
    df = Dataflow()
    df.matrix("x", [8, 12], "input")
    df.matrix("w", [12, 4], "weight")
    df.matrix("y", [8, 4], "activation")
    df.matrix("g", [12, 12], "activation")
    df.matrix("v", [4, 12], "weight")
    df.matmul("f", "x", "w", "y")
    df.matmul("gram", "x", "x", "g", transpose_a=True)
    df.matmul("t", "y", "v", "x")
    df.matmul("tt", "w", "g", "v", transpose_a=True, transpose_b=True)
    df.matrix("b", [4], "weight")
    df.matrix("c", [8], "weight")
    df.broadcast("bias", "b", "y")
    df.reduce("dbias", "y", "b")
    df.reduce("rowsum", "x", "c", axis=1)
    df.broadcast("colbias", "c", "x", axis=1)
    for order in ((2,), (2, 2), (3, 2)):
        names, doms, reference = tables(df, order)
        for mm, (scope, table) in zip(df.matmuls, reference):
            got_scope, got = cost_table(df, mm, doms, order)
            assert got_scope == scope
            np.testing.assert_allclose(got, table, rtol=1e-12)
        _, best = solve(df, order)
        assert best == pytest.approx(brute_force(df, order))


def test_min_sum_elimination_against_brute_force():
    rng = np.random.default_rng(3)
    for trial in range(30):
        names = list("abcdefg")
        domains = {x: int(rng.integers(1, 4)) for x in names}
        factors = []
        for _ in range(int(rng.integers(1, 9))):
            scope = tuple(rng.choice(names[:-1], size=int(rng.integers(1, 4)), replace=False))
            factors.append((scope, rng.random([domains[x] for x in scope])))
        index, total = min_sum.minimise(domains, factors)
        every = min(sum(t[tuple(dict(zip(names, combo))[x] for x in s)] for s, t in factors)
                    for combo in itertools.product(*(range(domains[x]) for x in names)))
        assert total == pytest.approx(every)
        assert sum(t[tuple(index[x] for x in s)] for s, t in factors) == pytest.approx(every)
        assert index["g"] == 0  # in no factor
    with pytest.raises(min_sum.TooLarge):
        min_sum.elimination_order({"a": 10, "b": 10}, [("a", "b")], budget=50)


def test_any_device_count_and_hierarchy():
    plan6 = plan_tiling(SOYBEAN_MLP, 6)
    assert sorted(plan6.cuts) == [2, 3] and plan6.total_bytes <= plan6.data_parallel_bytes
    plan12 = plan_tiling(mlp(24, [36] * 4), 12)
    assert sorted(plan12.cuts) == [2, 2, 3]
    # 2 hosts x 4 GPUs: the search minimises transfer time, trying every assignment of
    # cuts to links. Its time beats the bytes-optimal plan's under any assignment, and the
    # cut on the slow links carries the least traffic (Theorem 3 comes out of it).
    for df, hierarchy in ((SOYBEAN_MLP, ((2, 1.25), (4, 25.0))),
                          (SOYBEAN_MLP, ((4, 1.25), (2, 25.0))),
                          (mlp(256, [1024] * 5), ((2, 1.25), (8, 25.0)))):
        n = hierarchy[0][0] * hierarchy[1][0]
        mesh = DeviceMesh(tuple(MeshLevel(p, gbps * 1e9) for p, gbps in hierarchy))
        h = plan_tiling(df, mesh)
        assert h.mesh == mesh and h.devices == n and sorted(h.cut_bandwidths) == sorted(
            [bw for parts, bw in hierarchy for _ in range({2: 1, 4: 2, 8: 3}[parts])])
        assert sum(h.bytes_by_cut) == pytest.approx(h.total_bytes)
        plain = plan_tiling(df, n)
        assert sum(plain.bytes_by_cut) == pytest.approx(plain.total_bytes)

        def seconds(by_cut, bandwidths):
            return sum(b / (bw * 1e9) for b, bw in zip(by_cut, bandwidths))
        best_plain = min(seconds(plain.bytes_by_cut, p)
                         for p in itertools.permutations(h.cut_bandwidths))
        assert seconds(h.bytes_by_cut, h.cut_bandwidths) <= best_plain * (1 + 1e-12)
        slow = [b for b, bw in zip(h.bytes_by_cut, h.cut_bandwidths) if bw == 1.25]
        fast = [b for b, bw in zip(h.bytes_by_cut, h.cut_bandwidths) if bw != 1.25]
        assert max(slow) <= min(fast) + 1e-6
    # On SoyBean's MLP it pays: a little more traffic in all, less on the slow link.
    assert seconds(*(lambda p: (p.bytes_by_cut, p.cut_bandwidths))(plan_tiling(
        SOYBEAN_MLP, DeviceMesh.hosts(2, 4, 1.25e9, 25e9)))) < min(
        seconds(plan_tiling(SOYBEAN_MLP, 8).bytes_by_cut, p)
        for p in itertools.permutations((25.0, 25.0, 1.25)))
    with pytest.raises(ValueError, match="positive bandwidth"):
        DeviceMesh(((2, 0), (2, 25e9)))
    with pytest.raises(tfpar.TfparError, match="DeviceMesh"):
        plan_tiling(SOYBEAN_MLP, 4, time=True)


def test_plan_round_trips_and_prints():
    plan = plan_tiling(SOYBEAN_MLP, 4)
    assert TilingPlan.from_json(plan.to_json()) == plan
    text = plan.table()
    assert "W1" in text and "data parallel" in text and "model parallel" in text
    assert set(plan.placement) == {f"W{i}" for i in range(1, 6)}
    # Placement as ranges: each weight's tiles cover it, each element held by as many
    # devices as the tiling replicates it over.
    plan = plan_tiling(mlp(8, [12, 24, 6], bias=True), 8)
    for name, tiling in plan.placement.items():
        shape = plan.shapes[name]
        held = np.zeros(shape, int)
        for device in range(8):
            held[tuple(slice(lo, hi) for lo, hi in plan.tile(name, device))] += 1
        copies = 1
        for cut in tiling.cuts:
            copies *= cut.parts if cut.dim is None else 1
        assert (held == copies).all(), (name, tiling)
    rc = Tiling.parse("RC")
    assert [rc.tile_ranges((4, 6), d) for d in range(4)] == [
        ((0, 2), (0, 3)), ((0, 2), (3, 6)), ((2, 4), (0, 3)), ((2, 4), (3, 6))]


def test_a_cyclic_row_cut_deals_the_rows_out_in_turn():
    """`M` (rows dealt out over the parts in turn): every row held once, part k rows k,
    k + m, ...; as many rows per part as the range cut `R` gives it; no boxes."""
    for rows, m in ((20, 3), (7, 7), (9, 2), (6, 4)):
        cyclic, ranges = Tiling.parse(f"M{m}"), Tiling.parse(f"R{m}")
        assert str(cyclic) == (f"M{m}" if m != 2 else "M") and cyclic.cyclic
        assert not ranges.cyclic
        assert cyclic.tile_shape((rows, 5)) == ranges.tile_shape((rows, 5))
        held = np.zeros(rows, int)
        for k in range(m):
            box = cyclic.tile_slices((rows, 5), k)
            assert box[1] == slice(0, 5)
            picked = np.arange(rows)[box[0]]
            assert (picked % m == k).all()
            (lo, hi), _ = ranges.tile_ranges((rows, 5), k)
            assert len(picked) == hi - lo  # the same tile sizes as the ranges'
            held[picked] += 1
        assert (held == 1).all()
    assert str(Tiling.parse("M")) == "M" and Tiling.parse("M").cuts[0].parts == 2
    with pytest.raises(ValueError, match="not ranges"):
        Tiling.parse("M3").tile_ranges((9,), 0)
    with pytest.raises(ValueError, match="only a row cut"):
        Cut(1, 2, cyclic=True)
    with pytest.raises(ValueError, match="only cut"):
        Tiling((Cut(0, 2, cyclic=True), Cut(1, 2))).tile_slices((4, 4), 0)


def test_bad_input():
    with pytest.raises(tfpar.TfparError, match="positive int"):
        plan_tiling(SOYBEAN_MLP, 0)
    with pytest.raises(tfpar.TfparError, match="more than this graph can use"):
        plan_tiling(mlp(4, [4, 4]), 64)
    with pytest.raises(tfpar.TfparError, match="batch size"):
        mlp(None, [4, 4])
    from tfpar.partition.tiling.dataflow import Dataflow
    with pytest.raises(tfpar.TfparError, match="no matmuls"):
        plan_tiling(Dataflow(), 2)


def _tf_mlp(batch):
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [batch, 8], name="x")
        h = x
        for i, width in enumerate((16, 16, 4)):
            w = tf1.get_variable(f"w{i}", [h.shape[-1], width])
            h = tf.matmul(h, w)
            if i < 2:  # a bias, added the two usual ways
                b = tf1.get_variable(f"b{i}", [width])
                h = tf.tanh(tf.nn.bias_add(h, b) if i == 0 else h + b)
        loss = tf.reduce_mean(tf.square(h))
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return g


def test_extraction_from_a_real_graph():
    from tfpar.graph.extract import extract
    g = _tf_mlp(None)
    df = extract(g, tfpar.analyse(g), batch=32)
    causes = sorted(mm.cause for mm in df.matmuls)
    # 3 forward, 3 weight gradients, and the data gradients TensorFlow built (at least 2).
    assert causes.count("forward") == 3 and causes.count("backward_weight") == 3
    assert causes.count("backward_data") >= 2
    weights = {x for x, m in df.matrices.items() if m.kind == "weight"}
    assert weights == {"w0", "w1", "w2", "b0", "b1"}
    assert df.matrices["x"].shape == (32, 8) and df.matrices["b1"].shape == (16,)
    # Each weight gradient is written into its weight's matrix (an element-wise update).
    assert {mm.out for mm in df.matmuls if mm.cause == "backward_weight"} == {"w0", "w1", "w2"}
    # Bias adds (BiasAdd, and Add broadcasting) and bias gradients (BiasAddGrad, Sum).
    from tfpar.partition.tiling.dataflow import Broadcast, Reduce
    adds = [op for op in df.ops if isinstance(op, Broadcast)]
    sums = [op for op in df.ops if isinstance(op, Reduce)]
    assert sorted(op.a for op in adds) == ["b0", "b1"] and all(
        op.cause == "forward" for op in adds)
    assert sorted(op.out for op in sums) == ["b0", "b1"] and all(
        op.cause == "backward_weight" and df.matrices[op.a].kind == "gradient" for op in sums)
    # The bias add writes the matmul's own output matrix (joined through the add).
    assert {op.out for op in adds} <= {mm.out for mm in df.matmuls if mm.cause == "forward"}
    plan = plan_tiling(df, 4)
    assert plan.total_bytes <= min(plan.data_parallel_bytes, plan.model_parallel_bytes)
    with pytest.raises(tfpar.TfparError, match="unknown dimension"):
        extract(g, tfpar.analyse(g))


def test_tfpar_plan_tiling_on_the_examples():
    from tests.test_cli import MODEL, tfpar_cmd
    proc = tfpar_cmd("plan", MODEL, "--tiling", "--devices", "4")
    assert proc.returncode == 0, proc.stderr
    assert "tfpar tiling plan: 4 devices" in proc.stdout and "dense0/kernel" in proc.stdout
    proc = tfpar_cmd("plan", MODEL, "--tiling", "--devices", "4", "--json")
    plan = Plan.from_json(proc.stdout)  # the plan type get_runner consumes
    assert plan.tiling.devices == 4 and plan.num_workers == 4
    kernel = plan.variable("dense0/kernel")
    assert kernel.route == "tiled" and kernel.tiling == plan.tiling.tilings["dense0/kernel"]
    proc = tfpar_cmd("plan", MODEL, "--tiling", "--devices", "0")
    assert proc.returncode == 2 and "positive int" in proc.stderr
    proc = tfpar_cmd("plan", MODEL, "--tiling", "--devices", "4", "--time", "--link-gbps", "1")
    assert proc.returncode == 0, proc.stderr
    assert "time mode: MCMC" in proc.stdout and "simulated step time" in proc.stdout
    proc = tfpar_cmd("plan", MODEL, "--tiling", "--devices", "8", "--hosts", "2",
                     "--host-gbps", "1", "--link-gbps", "20", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = Plan.from_json(proc.stdout).tiling
    assert plan.mesh == DeviceMesh(((2, 1e9, 1e-5), (4, 20e9, 1e-5)), 10e12) and sorted(
        plan.cut_bandwidths) == [1, 20, 20]
    proc = tfpar_cmd("plan", MODEL, "--tiling", "--devices", "16", "--exact")
    assert proc.returncode == 0, proc.stderr
    assert "search: exact (joint over all cuts)" in proc.stdout
    proc = tfpar_cmd("plan", MODEL, "--tiling", "--devices", "8", "--hosts", "3")
    assert proc.returncode == 2 and "--hosts 3 does not divide 8 devices" in proc.stderr
