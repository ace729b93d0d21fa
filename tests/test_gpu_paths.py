"""GPU paths: built the same way as the CPU ones, run where GPUs exist, skipped here.

On a CPU-only machine these skip; the CPU-side checks of the same options
(nccl/hierarchical_copy refused on CPUs with a clear message) run in test_errors.py.
"""

import pytest
import tensorflow as tf

from helpers import small_config
from tfdist import devices
from tfdist.parallel import strategy as strategy_lib
from tfdist.testing import equivalence

GPUS = tf.config.list_physical_devices("GPU")
needs_gpus = pytest.mark.skipif(len(GPUS) < 2, reason="needs 2 GPUs (none on this machine)")


def test_gpu_device_strings_when_gpus_exist():
    if not GPUS:
        assert devices.configure(simulate_devices=2) == ["/cpu:0", "/cpu:1"]
    else:
        assert devices.configure(num_gpus=len(GPUS)) == [f"/gpu:{i}" for i in range(len(GPUS))]


@pytest.mark.parametrize("name,expected", [
    ("nccl", tf.distribute.NcclAllReduce),
    ("hierarchical_copy", tf.distribute.HierarchicalCopyAllReduce),
])
def test_gpu_all_reduce_options_are_built_with_packs(name, expected):
    ops = strategy_lib.cross_device_ops(name, 4, ["/gpu:0", "/gpu:1"])
    assert isinstance(ops, expected)


def test_auto_picks_nccl_on_gpus_and_reduction_to_one_device_on_cpus():
    assert isinstance(strategy_lib.cross_device_ops("auto", 1, ["/gpu:0", "/gpu:1"]),
                      tf.distribute.NcclAllReduce)
    assert isinstance(strategy_lib.cross_device_ops("auto", 1, ["/cpu:0", "/cpu:1"]),
                      tf.distribute.ReductionToOneDevice)


@needs_gpus
@pytest.mark.parametrize("ops", ["nccl", "hierarchical_copy"])
def test_mirrored_on_gpus_matches_default(ops):
    reference = equivalence.train(small_config(num_gpus=2, simulate_devices=0), "default")
    candidate = equivalence.train(small_config(strategy="mirrored", num_gpus=2,
                                               simulate_devices=0, cross_device_ops=ops), ops)
    equivalence.assert_equivalent(reference, candidate)
