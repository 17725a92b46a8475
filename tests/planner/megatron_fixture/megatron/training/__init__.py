# Test fixture: megatron.training reduced to its argument parser. arguments.py is Megatron-LM's
# megatron/training/arguments.py at tag core_v0.15.3, unchanged (BSD-3-Clause, NVIDIA; see
# LICENSE); the megatron-core 0.15.3 wheel supplies megatron.core. utils.py replaces the four
# helpers arguments.py imports from megatron/training/utils.py, which imports all of training.
