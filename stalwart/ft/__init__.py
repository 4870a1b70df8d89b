"""Fault tolerance, layered around the training loop (see docs/fault-tolerance.md).

plan.py        --fault.inject parsing, fired-fault markers, seeded chaos schedule      (pure)
detect.py      timeouts check, heartbeat watchdog, loss spikes, stragglers, restart policy (pure)
goodput.py     wall-time split and ETTR from events.jsonl + metrics.jsonl               (pure)
supervisor.py  the supervisor's decisions, driven with an explicit clock                (files only)
guard.py       the worker side: heartbeat thread and the trainer's per-step hooks
agent.py       torch's LocalElasticAgent with the supervisor plugged in; `stalwart train` launches it
"""
