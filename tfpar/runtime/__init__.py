"""The runtime layer: what needs a running job.

- `runner`: `get_runner` and the `Runner` a worker trains with.
- `job`: this process's Horovod job (layout, broadcast, initialisation, session config).
- `measure`: the measurements routing needs (rows, links), in the job.
- `trials`: the partition-count search's timed trials.
- `cluster`, `ps_process`, `ps_server`: the parameter servers (TensorFlow gRPC servers).
- `liveness`: arrival, heartbeats, deadlines and the last barrier.
- `checkpoint`: the single-device model's checkpoints.
- `sharding`: `tfpar.shard(dataset)`.
"""
