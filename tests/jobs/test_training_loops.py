"""Training loops as the field's scripts write them, each unchanged but for tfpar's
lines, against one device (tests/support/workers: ptb_tutorial.py, epochs.py,
keras_optimizers.py; one job for the three, their one-device references in one process):
TensorFlow's PTB tutorial with its Supervisor ported to tfpar.MonitoredTrainingSession,
the NMT tutorial's epochs ended by OutOfRangeError, and Keras layers trained by Keras's
optimizers in a TF1 graph. rtol 1e-5, atol 1e-6.
"""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.support.launch import WORKERS
from tests.support.one_device import assert_like_one_device, run_with_reference

LOOPS = ("ptb_tutorial", "epochs", "keras_optimizers")


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    """The folder each worker of LOOPS wrote its ranks' and one device's values to."""
    out = str(tmp_path_factory.mktemp("loops"))
    run_with_reference(os.path.join(WORKERS, "real_scripts.py"), out, *LOOPS, timeout=600)
    return lambda name: os.path.join(out, name)


def _moved(single, start, names, mode):
    """Training changed each of `names` (from the job's initial values)."""
    for name in names:
        assert not np.allclose(single[f"final/{name}"], start[f"init/{name}"]), (mode, name)


def test_the_ptb_tutorial_with_its_supervisor_ported_equals_single_device(loops):
    """TensorFlow's PTB tutorial as written (ptb_producer's queues; Train, Valid and Test
    models sharing the variables; the learning rate assigned between epochs; the LSTM
    state fetched from and fed back into the zero_state tensors; dict fetches; summaries
    of the losses), its Supervisor replaced by tfpar.MonitoredTrainingSession: every
    worker ends where one device does in TF's MonitoredTrainingSession on both workers'
    corpora (rtol 1e-5, atol 1e-6), the workers' mean log perplexity is one device's
    (train, valid and test, rtol 1e-5), and the chief's last checkpoint holds the
    single-device model; HYBRID, AR and sharded. (Before, in HYBRID and AR the chief's
    first summary took a batch from its queue alone, and the workers trained on batches
    out of step with one device's.)"""
    from tests.support.workers.ptb_tutorial import MODES
    for mode in MODES:
        folder = os.path.join(loops("ptb_tutorial"), mode)
        single, ranks = assert_like_one_device(folder)
        one = np.load(os.path.join(folder, "perplexities_single.npz"))
        each = [np.load(os.path.join(folder, f"perplexities_rank{r}.npz")) for r in range(2)]
        for key in ("train_ppl", "valid_ppl", "test_ppl"):
            mean_log = np.mean([np.log(got[key]) for got in each], axis=0)
            np.testing.assert_allclose(mean_log, np.log(one[key]), rtol=1e-5,
                                       err_msg=f"{mode}: {key}")
        assert int(single["final/Model/global_step"]) == 20  # 2 epochs of 10 steps
        _moved(single, ranks[0], ("Model/embedding", "Model/softmax_w"), mode)
        saved = tf.train.load_checkpoint(os.path.join(folder, "logdir"))
        for key in (k for k in single.files if k.startswith("final/")):
            np.testing.assert_allclose(saved.get_tensor(key[len("final/"):]), single[key],
                                       rtol=1e-5, atol=1e-6, err_msg=f"{mode}: {key}")


def test_epochs_ended_by_out_of_range_train_nothing_in_their_last_run(loops):
    """The NMT tutorial's epochs (an initializable iterator over tfpar.shard'ed examples,
    initialised at each epoch's start, trained until OutOfRangeError), Adam on an
    embedding and a dense layer: the run that ends each epoch trains nothing (no slot
    decayed, no step counted), so after 3 epochs every worker equals one device that
    ran the epochs' steps alone (rtol 1e-5, atol 1e-6), with the embedding on the
    servers, allgathered and sharded. (Before, the sharded rows' copy of Adam's update
    decayed its first moment in that run, as TF's own sparse Adam does on one device.)"""
    from tests.support.workers.epochs import MODES
    for mode in MODES:
        single, ranks = assert_like_one_device(os.path.join(loops("epochs"), mode))
        assert int(single["final/global_step"]) == 18  # 3 epochs of 24 / 4 examples
        _moved(single, ranks[0], ("emb", "emb/Adam", "w"), mode)


def test_keras_layers_trained_by_keras_optimizers_equal_single_device(loops):
    """Keras layers (an embedding, two dense) trained in a TF1 graph by Keras's legacy
    optimizers (Adam, SGD with momentum, FTRL, RMSprop: their own update ops, Adam's
    sparse update a decay of each whole slot, then a scatter_add of the rows): every worker ends where
    one device does on both workers' batches, the embedding on the servers (HYBRID; and
    PS mode for Adam), allgathered (AR) and sharded; rtol 1e-5, atol 1e-6."""
    from tests.support.workers.keras_optimizers import OPTIMIZERS, modes
    routes = {"HYBRID": "ps", "PS": "ps", "AR": "allgather", "SHARDED": "sharded"}
    for optimizer in OPTIMIZERS:
        for mode in modes(optimizer):
            route = routes[mode]
            single, ranks = assert_like_one_device(
                os.path.join(loops("keras_optimizers"), optimizer, mode))
            plan = {v["name"]: v for v in json.loads(str(ranks[0]["plan"]))["variables"]}
            assert plan["embedding/embeddings"]["route"] == route, (optimizer, mode)
            _moved(single, ranks[0], ("embedding/embeddings", "dense/kernel"), mode)
