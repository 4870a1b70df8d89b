"""Cluster-scale simulation of one long training job (failures, recovery, checkpoints, power) and of
several jobs sharing a cluster. Pure Python + numpy: no training process is started.

Layout: ``causes`` (the failure catalogue and its Llama 3 calibration), ``config`` (the typed config
tree), ``engine`` (one replication, event by event, whole-job or per-replica-group recovery),
``recovery`` (what a recovery costs and its assumptions), ``montecarlo`` (seeded replications and
confidence intervals), ``daly`` (Young/Daly checkpoint interval), ``power`` (facility power swings),
``cluster`` (multi-job scheduling with topology-aware placement), ``sweep`` (what-ifs), ``report``
(table, JSON, plot); the command is ``stalwart.cli.simulate``.
"""
