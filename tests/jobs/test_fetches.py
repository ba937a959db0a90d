"""Runner.run fetches and feeds whatever a plain tf.compat.v1.Session does, with its results
(tests/support/workers/fetches.py): assign-family results of resource (TF2) and reference (TF1)
variables on a replicated, an allreduced, a parameter-server and a sharded variable,
`tf.group`, an assignment's op, IndexedSlices, SparseTensor and string fetches, a norm
over every gradient (one device's: of the workers' gradients combined), in HYBRID
and PS modes and with the sparse variable's rows sharded over the workers (an assignment
of a sharded variable writes every worker's rows; workers that assign different values
are refused, nothing written), on 2 workers. Values agree within fp32 rounding (rtol 1e-6)."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.support.launch import WORKERS, horovodrun



def _same(got, want, where):
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got, want)
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list) and want and isinstance(want[0], str):
        assert got == want, where
    elif isinstance(want, list) and np.array(want, dtype=object).ndim == 1 and any(
            isinstance(w, list) for w in want):  # a list of differently shaped values
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{where}[{i}]")
    elif want is None or isinstance(want, str):
        assert got == want, (where, got, want)
    else:
        np.testing.assert_allclose(np.array(got, dtype=float), np.array(want, dtype=float),
                                   rtol=1e-6, err_msg=where)


@pytest.mark.parametrize("tf1", [False, True], ids=["tf2", "tf1"])
def test_fetches_equal_a_plain_session(tmp_path, tf1):
    proc = horovodrun(2, os.path.join(WORKERS, "fetches.py"), str(tmp_path),
                      *(["--tf1"] if tf1 else []), timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for mode, routes in (("HYBRID", {"emb": "ps", "w": "allreduce"}),
                         ("PS", {"emb": "ps", "w": "ps"}),
                         ("SHARDED", {"emb": "sharded", "w": "allreduce"})):
        for rank in range(2):
            with open(tmp_path / mode / f"rank{rank}.json") as f:
                compared = json.load(f)
            plan = compared.pop("plan")
            assert {k: plan[k] for k in routes} == routes
            assert plan["lr"] == plan["counter"] == "replicated"
            assert compared["group"] == [None, None] and compared["assign_op"] == [None, None]
            assert compared["assign_w"][0] == [[0.0], [1.0], [2.0]]
            assert compared["assign_lr"][0] == pytest.approx(0.05 * (rank + 1))
            assert compared["string"][0] == compared["string"][1]
            # partial writes of the embedding were fetched, and its rows after them
            assert {"scatter_emb", "row_assign_emb", "scatter_nd_emb"} <= set(compared)
            assert "gradient_norm" in compared  # one device's norm, not the worker's
            if mode == "SHARDED":
                assert {"scatter_add_emb", "different_values_scatter_nd_emb",
                        "different_values_scatter_add_emb"} <= set(compared)
            for key, (got, want) in compared.items():
                _same(got, want, f"{mode} worker {rank} {key}")
    # One training step, so one checkpoint: the collective fetches around it (a sharded
    # variable's assignment and whole reads) are no steps.
    state = tf.train.get_checkpoint_state(str(tmp_path / "SHARDED_checkpoints"))
    assert [p.rsplit("-", 1)[1] for p in state.all_model_checkpoint_paths] == ["1"]


def test_a_users_initializer_and_load_leave_every_worker_with_one_model(tmp_path):
    """After the runner exists, every worker runs the user's
    global_variables_initializer() (unseeded: each draws its own values) and a
    Variable.load of a value that differs per worker, as TF1 and Horovod scripts do: the
    workers then hold worker 0's values, exactly, the variables on the parameter servers
    and sharded ones included, and keep training one model. Before, each worker kept its
    own draw of the replicated ones and trained on apart, and the others were not
    re-initialised at all, silently."""
    proc = horovodrun(2, os.path.join(WORKERS, "reinit.py"), str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for mode in ("HYBRID", "AR", "SHARDED"):
        ranks = [np.load(os.path.join(str(tmp_path), mode, f"rank{r}.npz")) for r in range(2)]
        for key in ranks[0].files:
            np.testing.assert_array_equal(ranks[1][key], ranks[0][key], err_msg=f"{mode} {key}")
        ours = ranks[0]
        for name in ("w", "emb", "emb/Adagrad"):  # re-initialised, wherever it is kept
            assert not np.allclose(ours[f"init/{name}"], ours[f"trained/{name}"]), (mode, name)
        assert int(ours["init/global_step"]) == 0 and int(ours["final/global_step"]) == 2
        np.testing.assert_array_equal(ours["loaded/w"], np.full([4, 1], 1.0))  # worker 0's
        np.testing.assert_array_equal(ours["loaded/emb"], np.full([20, 4], 2.0))
        assert not np.allclose(ours["final/w"], ours["loaded/w"])  # and trained on
