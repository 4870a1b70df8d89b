"""Fault tolerance, layered around the training loop (see docs/fault-tolerance.md).

detect.py      heartbeat watchdog, loss spikes, stragglers, restart policy              (pure)
origin.py      whether a failure came from outside the job (kill -9, SIGSTOP; OOM evidence)
plan.py        fired-fault markers and the seeded chaos schedule (grammar: config/fault_plan.py)
supervisor.py  the supervisor's decisions, driven with an explicit clock                (files only)
records.py     the files under <run>/ft/: heartbeats, exit records, skip list, exclusions
gate.py        the contract between the optimizer wrapper and whoever decides a step commits
guard.py       the worker side: heartbeat thread, the optimizer gate (skip, rollback, spikes, stragglers)
inject.py      fault injection, registered only when fault.inject or chaos is configured

The process layer (torch's elastic agent with the supervisor plugged in) is stalwart.launch. Goodput is
computed by stalwart.observe.goodput, the one calculation every view shares.
"""
