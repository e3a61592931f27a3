"""Tensor parallelism for the target: sharding (tensor_parallel), per-rank start-up (build) and the
worker processes (group). See README, 'Tensor parallelism'."""
