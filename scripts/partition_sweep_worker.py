"""One worker of the partition benchmark (run by scripts/benchmark_partitions.py).

usage: PYTHONPATH=. horovodrun -np N python scripts/partition_sweep_worker.py OUT.json VOCAB MAX_P STEPS
Times the language model for every partition count 1..MAX_P (one runner each, same job),
then runs tfpar's search (forced, fresh memory) and records what it chose.
"""
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
from examples import lm  # noqa: E402
import tfpar  # noqa: E402
from tfpar.runtime import job  # noqa: E402
from tfpar.runtime import trials as counts  # noqa: E402


def main(out, vocab, max_p, steps):
    graph, _, train_op = lm.build_graph(vocab=vocab, max_partitions=max_p)
    warmup = max(5, steps // 5)
    sweep = {}
    for p in range(1, max_p + 1):
        with tfpar.get_runner(graph, config=tfpar.Config(partitions=p)) as runner:
            mine = counts.timed_steps(runner, train_op, None, warmup, steps)
            times = [float(t) for t in job.allgather_strings(repr(mine))]
            sweep[p] = sum(times) / len(times)
            if runner.is_chief:
                print(f"P={p:3d}: {sweep[p] * 1e3:.2f} ms/step", flush=True)
    with tempfile.TemporaryDirectory() as cache:
        config = tfpar.Config(search_partitions="force", search_cache=cache,
                              search_steps=(warmup, steps))
        with tfpar.get_runner(graph, config=config) as runner:
            (decision,) = runner.plan.partition_search.values()
            if runner.is_chief:
                with open(out, "w") as f:
                    json.dump({"vocab": vocab, "workers": runner.num_workers, "steps": steps,
                               "sweep": sweep, "search": decision.to_dict()}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
