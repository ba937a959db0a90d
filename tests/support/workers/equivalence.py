"""Runs training scenarios as one worker of a horovodrun job and saves every variable.

usage: horovodrun -np N -H localhost:N python equivalence.py SCENARIOS_JSON OUT_DIR
Each scenario: {"name", "model": kwargs of models.build, "config": kwargs of tfpar.Config,
"steps", "batch"}. Writes OUT_DIR/<name>/rank<r>.npz with init/ and final/ values.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.support import models  # noqa: E402
import tfpar  # noqa: E402

tf.compat.v1.disable_eager_execution()


def main(scenarios_path, out_dir):
    for sc, graph, h, session_config in models.worker_scenarios(scenarios_path):
        extra = {}
        if sc.get("feed_trials"):  # steps run before training (density measurement) are fed
            trial_batches = models.batches(3, sc["batch"], seed=1, vocab=sc.get("vocab"))
            extra["search_feed"] = lambda step: models.feed(h, *trial_batches[step % 3])
        config = tfpar.Config(session_config=session_config, **sc["config"], **extra)
        with tfpar.get_runner(graph, sc.get("resources"), config) as runner:
            variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            names = [v.op.name for v in variables]
            init = runner.run(variables)
            b = sc["batch"]
            lo, hi = runner.worker_id * b, (runner.worker_id + 1) * b
            losses = []
            for x, y, ids in models.batches(sc["steps"], b * runner.num_workers,
                                            vocab=sc.get("vocab")):
                loss, _ = runner.run([h["loss"], h["train_op"]],
                                     feed_dict=models.feed(h, x[lo:hi], y[lo:hi], ids[lo:hi]))
                losses.append(loss)
            final = runner.run(variables)
            # Who listens and what this worker started, after training (route "sharded"
            # must start no server: the same sockets as a Horovod-only job).
            me = psutil.Process()
            listening = sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in me.net_connections("tcp")
                               if c.status == psutil.CONN_LISTEN)
            d = os.path.join(out_dir, sc["name"])
            eval_loss = {}
            if "training" in [op.name for op in graph.get_operations()]:
                # Inference mode (a batch norm's training=<a tensor> fed False) on every
                # worker: the moving averages, as on one device.
                x, y, ids = models.eval_batch(b * runner.num_workers, sc.get("vocab"))
                eval_loss["eval_loss"] = runner.run(h["loss"], feed_dict={
                    **models.feed(h, x[lo:hi], y[lo:hi], ids[lo:hi]),
                    graph.get_tensor_by_name("training:0"): False})
            os.makedirs(d, exist_ok=True)
            arrays = {f"init/{n}": v for n, v in zip(names, init)}
            arrays.update({f"final/{n}": v for n, v in zip(names, final)})
            arrays["losses"] = np.array(losses)
            arrays["listening"] = np.array(json.dumps(listening))
            arrays["children"] = np.array(json.dumps([" ".join(c.cmdline()) for c in
                                                      me.children(recursive=True)]))
            arrays.update(eval_loss)
            arrays["plan"] = np.array(runner.plan.to_json())
            # The step's collectives as the liveness hub compares them across workers.
            arrays["step_collectives"] = np.array(runner._collectives(
                [h["loss"], h["train_op"]], None)[0])
            arrays["communication"] = np.array(json.dumps(runner.communication()))
            arrays["ps_pushes"] = np.array(json.dumps(runner.ps_pushes()))
            arrays["alltoalls"] = np.array(json.dumps(sorted(
                op.get_attr("tensor_name") if "tensor_name" in op.node_def.attr else op.name
                for op in runner.rewritten_graph.get_operations() if op.type == "HorovodAlltoall")))
            np.savez(os.path.join(d, f"rank{runner.worker_id}.npz"), **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
