"""The code sandbox, a service of its own that RL's reward workers use.

`local.Sandbox` runs untrusted Python programs against test cases under bubblewrap, rlimits and a
seccomp filter (`runner.py` is the trusted runner inside); `verdicts` is what goes in and comes out
(cases, runs, verdicts: pure logic); `service` serves a `Sandbox` over HTTP (`stalwart sandbox
serve`); `client.SandboxClient` scores programs on a fleet of services with the same `score` /
`score_many` as a `Sandbox`. Nothing here imports Monarch, torch or the model code.
"""
