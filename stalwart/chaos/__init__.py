"""Chaos from outside the job: the faults a cluster delivers (kill -9, SIGSTOP, a slowed rank, a full
disk during a save, a partitioned rank, a corrupted memory snapshot; against replica groups also a
whole group killed, or a rank of every group) sent to a running `stalwart train` by another process,
on a seeded schedule, ending with a comparison against a clean run (`stalwart chaos`;
docs/fault-tolerance.md, docs/group-recovery.md)."""
