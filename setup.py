from setuptools import find_packages, setup

setup(
    name="tfpar",
    version="0.1.0",
    description="Automatic hybrid data/model parallelism for tf.compat.v1 training graphs",
    packages=find_packages(include=["tfpar", "tfpar.*"]),
    python_requires=">=3.11,<3.12",
    # horovod is compiled from source against the exact TF build (scripts/bootstrap.sh);
    # listing it here would let pip build an incompatible copy.
    # TensorFlow (tensorflow-cpu or tensorflow with CUDA, 2.18.1) and horovod are installed
    # by scripts/bootstrap.sh: the right TF package depends on the host.
    install_requires=["numpy", "protobuf"],
    entry_points={"console_scripts": ["tfpar=tfpar.cli:main"]},
)
