"""Parallelism applied to a single-device model from outside, one module per technique.

Order of application (see `stalwart.parallel.apply.parallelize`): pipeline split -> tensor/sequence
parallel -> context parallel -> activation checkpointing -> compile -> FSDP/HSDP.
"""
