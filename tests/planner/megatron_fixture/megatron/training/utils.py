"""The helpers megatron/training/arguments.py (core_v0.15.3) imports from training/utils.py,
without the rest of Megatron's training package. The GPU architecture comes from the test."""

import os
import warnings

ARCH_ENV = "MOEPLAN_TEST_GPU_ARCH"
"""Major compute capability of the GPUs the export targets (8 Ampere, 9 Hopper, 10 Blackwell):
validate_args asks for it, and the test sets it per cluster."""


def get_device_arch_version():
    return int(os.environ[ARCH_ENV])


def update_use_dist_ckpt(args):
    args.use_dist_ckpt = args.ckpt_format != "torch"


def print_rank_0(message, rank=None):
    """Megatron's rank-0 logging, silenced: the checks' refusals are what the tests read."""


def warn_rank_0(message, rank=None):
    warnings.warn(message, stacklevel=2)
