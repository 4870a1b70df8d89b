"""Training: the reusable core (``core.TrainCore``), the pre-training loop (``trainer.Trainer``) and its
components (observer, evaluator, checkpointer), initialisation, optimizers and schedules, and the
worker entry point."""
