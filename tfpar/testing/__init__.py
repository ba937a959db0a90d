"""Tools for testing and benchmarking tfpar, not used by a training job.

- `emulate`: an emulated cluster on one machine (network namespaces, shaped links, sshd).
- `launch`: the `horovodrun` command lines tests and benchmarks start jobs with.
"""
