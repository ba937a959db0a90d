"""The `tfpar` command: look at what tfpar sees in a graph and what it would do, offline,
and run a job that is relaunched after faults.

    tfpar inspect model.py[:build_fn]      per-variable analysis table
    tfpar plan model.py[:build_fn] --resources host1:2,host2:2 [--run-mode AR] [--json]
    tfpar run [--restarts K] [--min-np N] -np 4 -H a:2,b:2 -- python train.py

A source is a Python file with a function that builds the training graph (default name
`build_graph`; it returns a tf.Graph, a tuple starting with one, or builds into the default
graph), or a saved MetaGraphDef (`.meta`, binary or text).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def load_graph(source: str):
    """A tf.Graph or MetaGraphDef from `file.py[:function]` or a `.meta` file."""
    import tensorflow as tf
    from tfpar.errors import TfparError

    tf.compat.v1.disable_eager_execution()
    path, _, func = source.partition(":") if not os.path.exists(source) else (source, "", "")
    if not os.path.exists(path):
        raise TfparError(f"{path}: no such file")
    if not path.endswith(".py"):
        meta = tf.compat.v1.MetaGraphDef()
        data = open(path, "rb").read()
        try:
            meta.ParseFromString(data)
        except Exception:  # noqa: BLE001 - try the text format next
            from google.protobuf import text_format
            try:
                text_format.Merge(data.decode(), meta)
            except Exception as e:  # noqa: BLE001
                raise TfparError(f"{path} is neither a Python file nor a MetaGraphDef: {e}") from None
        return meta
    spec = importlib.util.spec_from_file_location("_tfpar_user_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec.loader.exec_module(module)
    func = func or "build_graph"
    fn = getattr(module, func, None)
    if not callable(fn):
        raise TfparError(f"{path} has no function {func}(); name the graph-building function "
                         f"as {path}:FUNCTION")
    graph = tf.Graph()
    with graph.as_default():
        result = fn()
    if isinstance(result, tuple) and result:
        result = result[0]
    if isinstance(result, (tf.Graph, tf.compat.v1.MetaGraphDef)):
        return result
    if result is None:
        return graph
    raise TfparError(f"{path}:{func}() returned {type(result).__name__}; return a tf.Graph")


def _plan_tiling(args, graph, analysis, scope):
    """`tfpar plan --tiling`: the tiling planner's result for the devices asked for, and the
    layout of workers it is for (one per device)."""
    from tfpar.errors import TfparError
    from tfpar.plan.mesh import DeviceMesh
    from tfpar.graph.extract import extract
    from tfpar.partition.tiling.planner import EXACT_LIMITS, plan_tiling
    from tfpar.plan.layout import parse_resources

    if args.devices is None:
        layout = parse_resources(args.resources)
        devices = layout.num_workers
    else:
        devices, layout = args.devices, None
    if devices < 1:
        raise TfparError(f"the number of devices must be a positive int, got {devices}")
    if args.hosts is not None and (args.hosts < 1 or devices % args.hosts):
        raise TfparError(f"--hosts {args.hosts} does not divide {devices} devices "
                         "into equal hosts")
    per_host = devices // (args.hosts or 1)
    if layout is None:
        layout = parse_resources(",".join(f"host{i}:{per_host}" for i in range(args.hosts))
                                 if args.hosts else f"localhost:{devices}")
    mesh = (DeviceMesh.hosts(args.hosts, per_host, args.host_gbps * 1e9, args.link_gbps * 1e9,
                             args.latency_us / 1e6, args.tflops * 1e12)
            if args.hosts is not None else
            DeviceMesh.flat(devices, args.link_gbps * 1e9, args.latency_us / 1e6,
                            args.tflops * 1e12))
    # Without --hosts or --time the plan minimises bytes: a count is enough.
    target = mesh if args.hosts is not None or args.time else devices
    tiling = plan_tiling(extract(graph, analysis, args.batch, scope), target, time=args.time,
                         exact_limits=EXACT_LIMITS if args.exact else None)
    return tiling, layout


RUN_OPTIONS = {"--restarts": int, "--window": float, "--host-failures": int, "--min-np": int}


def run_command(argv) -> int:
    """`tfpar run [--restarts K] [--window S] [--host-failures M] [--min-np N]
    [horovodrun options] -- command...`: the job, relaunched after faults
    (tfpar.supervisor)."""
    from tfpar import supervisor
    try:
        options, command = supervisor.split_command(argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    ours, rest, i = {}, [], 0
    while i < len(options):
        if options[i] in RUN_OPTIONS and i + 1 < len(options):
            ours[options[i][2:].replace("-", "_")] = RUN_OPTIONS[options[i]](options[i + 1])
            i += 2
        else:
            rest.append(options[i])
            i += 1
    if not command:
        print("tfpar run: no command after `--`", file=sys.stderr)
        return 2
    return supervisor.run(rest, command, **ours)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        return run_command(argv[1:])
    parser = argparse.ArgumentParser(prog="tfpar", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="print the per-variable analysis of a graph")
    plan = sub.add_parser("plan", help="print the plan tfpar would run, without a cluster")
    for p in (inspect, plan):
        p.add_argument("source", help="model.py[:build_fn] or a .meta MetaGraphDef")
        p.add_argument("--gradient-scope", help="regex of the tf.gradients name scopes")
    plan.add_argument("--resources", default="localhost:1", help="e.g. host1:2,host2:2 or a file")
    plan.add_argument("--run-mode", default="HYBRID", help="HYBRID, AR or PS")
    plan.add_argument("--sum", action="store_true", help="sum gradients instead of averaging")
    plan.add_argument("--partitions", type=int, help="parts per sparse variable on the PS "
                      "(default: one per PS task)")
    plan.add_argument("--sparse-route", default="ps",
                      choices=("ps", "allreduce", "allgather", "sharded", "auto"),
                      help="HYBRID: sparse variables on the parameter servers, through "
                      "a dense allreduce, Horovod's allgather, their rows sharded over the "
                      "workers (all-to-all), or routed by density (measured only in a job: "
                      "the plan keeps them on the servers and says so)")
    plan.add_argument("--sharded-rows", default="auto", choices=("auto", "modulo", "ranges"),
                      help="route sharded: row i on worker i %% N (modulo; what auto takes "
                      "without a job's measurement) or each worker a range of rows")
    plan.add_argument("--no-local-aggregation", action="store_true",
                      help="push every worker's gradient to the PS (not one push per host)")
    plan.add_argument("--allreduce-by-allgather", default="auto", choices=("on", "off", "auto"),
                      help="the dense gradients in the allgather route's allgather, or where "
                      "only the sharded route runs, in its gradients' all-to-all (auto: "
                      "where a job measured that it pays; the plan's notes say why not)")
    plan.add_argument("--search-cache", help="folder of remembered partition searches "
                      "(default ~/.cache/tfpar/partitions)")
    plan.add_argument("--forget-search", action="store_true",
                      help="delete the remembered partition search of this graph and layout, "
                      "so the next job searches again")
    plan.add_argument("--tiling", action="store_true",
                      help="also plan tilings of the matmuls (model/hybrid parallelism): "
                      "their weights get route 'tiled'")
    plan.add_argument("--devices", type=int, help="devices for --tiling (default: workers)")
    plan.add_argument("--batch", type=int, help="batch size for --tiling, where the graph "
                      "leaves it unknown")
    plan.add_argument("--time", action="store_true", help="--tiling in time mode: simulate "
                      "step time (compute + alpha-beta links) and search it with MCMC")
    plan.add_argument("--tflops", type=float, default=10.0, help="per device, for --time")
    plan.add_argument("--link-gbps", type=float, default=10.0,
                      help="link bandwidth in GB/s (inside a host with --hosts), for --time "
                      "and --hosts")
    plan.add_argument("--hosts", type=int, help="--tiling on this many hosts of equal "
                      "devices: cuts are placed on links by bandwidth (--host-gbps between "
                      "hosts, --link-gbps inside)")
    plan.add_argument("--exact", action="store_true", help="--tiling: let the exact joint "
                      "search use up to about 1 GB and a minute before it falls back")
    plan.add_argument("--host-gbps", type=float, default=1.25,
                      help="bandwidth between hosts in GB/s, with --hosts")
    plan.add_argument("--latency-us", type=float, default=10.0,
                      help="per-message latency in microseconds, for --time")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)

    from tfpar.runtime import trials
    from tfpar.graph.analysis import DEFAULT_GRADIENT_SCOPE, analyse
    from tfpar.plan.config import Config
    from tfpar.errors import TfparError
    from tfpar.plan.measurements import Measurements
    from tfpar.plan.planner import make_plan
    from tfpar.plan.layout import parse_resources

    try:
        scope = args.gradient_scope or DEFAULT_GRADIENT_SCOPE
        graph = load_graph(args.source)
        analysis = analyse(graph, scope, strict=args.command == "inspect")
        if args.command == "inspect":
            print(analysis.table())
            print(f"global step: {analysis.global_step or '-'}; "
                  f"train ops: {', '.join(analysis.train_ops) or '-'}")
            return 0
        import tensorflow as tf
        from tfpar.graph.graph_copy import copy_graph, to_meta_graph
        source = graph if isinstance(graph, tf.Graph) else copy_graph(graph)
        tiling = None
        if args.tiling:
            tiling, layout = _plan_tiling(args, source, analysis, scope)
        else:
            layout = parse_resources(args.resources)
        if any(h.slots is None for h in layout.hosts):
            raise TfparError("tfpar plan needs a worker count per host: give GPU ids in the "
                             "resource file, or use --resources host:N,...")
        config = Config(run_mode=args.run_mode, average_dense=not args.sum,
                        average_sparse=not args.sum, gradient_scope=scope,
                        partitions=args.partitions, search_cache=args.search_cache,
                        local_aggregation=not args.no_local_aggregation,
                        sparse_route=args.sparse_route, sharded_rows=args.sharded_rows,
                        allreduce_by_allgather={"on": True, "off": False, "auto": "auto"}[
                            args.allreduce_by_allgather])
        measured, notes = trials.resolve_counts(
            source, to_meta_graph(graph), analysis, config, layout, Measurements(),
            forget=args.forget_search)
        result = make_plan(analysis, config, layout, measured)
        if tiling is not None:
            result = result.with_tiling(tiling)
        print(result.to_json() if args.json else result.table())
        for n in notes:
            print(f"note: {n}", file=sys.stderr if args.json else sys.stdout)
        return 0
    except TfparError as e:
        print(f"tfpar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
