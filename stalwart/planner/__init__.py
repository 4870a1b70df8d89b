"""Parallelism planner: enumerate layouts (dp/fsdp, tp, pp + schedule, cp, micro-batch, activation
checkpointing), predict per-GPU memory and step time from first principles, rank what fits.

Layout: ``shapes`` (model shapes and FLOPs), ``hardware`` (GPU and network specs), ``layout`` (one
candidate), ``memory`` (pure per-rank byte model), ``cost`` (step-time model and its calibration
constants), ``search`` (enumerate and rank), ``published`` + ``calibration`` + ``validation`` (published rows, the fit,
the check), ``islands`` (islands over a slow link), ``config``. The
commands are ``stalwart.cli.plan`` and ``stalwart.cli.serve_plan``.
"""
