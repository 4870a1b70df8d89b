"""fault.group_recovery, pure logic: a step's leaves over the groups present, the tree's bits whoever
computes them, the lighthouse's epochs and the workers' votes (on an in-process store)."""

import itertools
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from stalwart.errors import UserError
from stalwart.launch.lighthouse import Lighthouse
from stalwart.parallel.elastic import TreeAccumulator
from stalwart.parallel.elastic import GroupTree
from stalwart.parallel.regroup import assignment, check_groups, own_leaves
from stalwart.runtime.quorum import ABORT, COMMIT, NEXT, QuorumClient


def _values(leaves: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(leaves)
    return [torch.randn(67, generator=gen) * 10 ** torch.randint(-3, 4, (67,), generator=gen) for _ in range(leaves)]


def _reference(values: list[torch.Tensor]) -> torch.Tensor:
    acc = TreeAccumulator(len(values), 0, 1)
    for v in values:
        acc.push(v)
    return acc.total()


@pytest.mark.unit
@pytest.mark.parametrize("groups,size,leaves", [(2, 1, 2), (2, 1, 8), (3, 1, 6), (4, 1, 8), (2, 2, 8), (4, 2, 16)])
def test_every_leaf_once_and_the_same_bits_whichever_groups_are_present(groups, size, leaves):
    values = _values(leaves)
    reference = _reference(values)
    for k in range(1, groups + 1):
        for present in itertools.combinations(range(groups), k):
            assign = assignment(leaves, groups, size, list(present))
            covered = sorted(i for ivs in assign.values() for lo, hi in ivs for i in range(lo, hi))
            assert covered == list(range(leaves)), (present, assign)
            for g in present:  # a present rank always keeps its own leaves
                for s in range(size):
                    assert own_leaves(leaves, groups, size, g, s) in assign[(g, s)]
            layout, width = GroupTree.layout(assign)
            rows = []
            for rank in sorted(assign):
                tree = GroupTree(leaves)
                for iv in assign[rank]:
                    for leaf in range(*iv):
                        tree.push(iv, leaf, values[leaf])
                rows.append(tree.mine(assign[rank], width))
            assert torch.equal(GroupTree(leaves).root(torch.cat(rows), assign), reference), present


@pytest.mark.unit
def test_a_redo_after_a_second_loss_recomputes_only_what_changed():
    """Group 3 lost, then group 1 during the redo: each survivor keeps what it computed and adds the
    rest; the root is still the full job's."""
    leaves, values = 8, _values(8)
    first, second = assignment(leaves, 4, 1, [0, 1, 2]), assignment(leaves, 4, 1, [0, 2])
    trees = {g: GroupTree(leaves) for g in (0, 2)}
    computed = {g: 0 for g in trees}
    for assign in (first, second):
        for g, tree in trees.items():
            for iv in assign[(g, 0)]:
                if not tree.have(iv):
                    tree.drop(iv)
                    for leaf in range(*iv):
                        tree.push(iv, leaf, values[leaf])
                        computed[g] += 1
    _, width = GroupTree.layout(second)
    gathered = torch.cat([trees[g].mine(second[(g, 0)], width) for g in (0, 2)])
    assert torch.equal(GroupTree(leaves).root(gathered, second), _reference(values))
    # group 0: its own 2, (6,7) for group 3, then (2,3) for group 1 ((6,7) kept); group 2: its own, (3,4), (7,8)
    assert computed == {0: 4, 2: 4}
    with pytest.raises(UserError, match="split evenly"):
        check_groups(6, 4, 1)


def _store():
    return dist.PrefixStore("q", dist.HashStore())


def _votes(clients, epoch, step, groups):
    with ThreadPoolExecutor(len(groups)) as pool:
        return [f.result(timeout=5) for f in [pool.submit(clients[g].vote, epoch, step, True) for g in groups]]


def _register(store, g: int, step: int, attempt: int = 0) -> None:
    QuorumClient("", g, 1, 0, 5, store=store).register(attempt, step)


@pytest.mark.unit
def test_lighthouse_start_loss_rejoin_and_whole_job_fallback():
    store, events = _store(), []
    lh = Lighthouse(store, 3, rejoin_timeout_s=10, log_event=lambda name, **kw: events.append((name, kw)))
    _register(store, 0, 5)
    _register(store, 1, 7)
    lh.tick(0.0)
    assert lh.members == []  # waits for every group (up to the rejoin timeout)
    _register(store, 2, 7)
    lh.tick(1.0)
    epoch = json.loads(store.get("e1"))
    assert epoch["members"] == [0, 1, 2] and epoch["source"] == 1 and epoch["joiners"] == [0]  # newest state
    assert store.get("live") == b"1"
    clients = {g: QuorumClient("", g, 1, 0, 5, store=store) for g in range(3)}
    assert clients[0].admitted(0)["id"] == 1

    # Group 2 fails while the others wait for its vote: the epoch is broken, their step aborts, and the
    # next epoch is the survivors.
    with ThreadPoolExecutor(3) as pool:
        waiting = [pool.submit(clients[g].vote, epoch, 1, True) for g in (0, 1)]
        store.add("failed/2", 1)
        lh.tick(2.0)
        assert [w.result(timeout=5) for w in waiting] == [ABORT, ABORT]
    assert json.loads(store.get("e2"))["members"] == [0, 1]
    e2 = clients[0].next_epoch(1)

    # Group 2 comes back: a proposal, taken by the rank that decides the next step.
    _register(store, 2, -1, attempt=1)
    lh.tick(3.0)
    assert json.loads(store.get("e2/next"))["joiners"] == [2]
    assert _votes(clients, e2, 2, (0, 1)) == [NEXT, NEXT]
    lh.tick(4.0)
    e3 = clients[2].admitted(1)
    assert e3["members"] == [0, 1, 2] and e3["source"] == 0 and lh.epoch == 3
    assert [n for n, _ in events].count("group_rejoined") == 1

    # A step of the full epoch commits; then every group fails: whole-job fallback, a new start.
    assert _votes(clients, e3, 3, (0, 1, 2)) == [COMMIT] * 3
    for g in range(3):
        store.add(f"failed/{g}", 1)
    lh.tick(5.0)
    assert lh.members == [] and store.get("live") == b"0"
    assert "group_whole_job_fallback" in [n for n, _ in events]
    for g in range(3):
        _register(store, g, 10, attempt=2)
    lh.tick(6.0)
    assert json.loads(store.get(f"e{lh.epoch}"))["members"] == [0, 1, 2] and store.get("live") == b"1"


@pytest.mark.unit
def test_a_failure_withdraws_a_proposal_not_yet_taken():
    store = _store()
    lh = Lighthouse(store, 2, rejoin_timeout_s=10, log_event=lambda *a, **k: None)
    _register(store, 0, 0)
    _register(store, 1, 0)
    lh.tick(0.0)
    store.add("failed/1", 1)
    lh.tick(1.0)
    _register(store, 1, -1, attempt=1)
    lh.tick(2.0)
    assert lh.proposal is not None
    store.add("failed/1", 1)  # the joiner fails before any step took it
    lh.tick(3.0)
    assert lh.proposal is None and store.get(f"e{lh.epoch}/next") == b"withdrawn" and lh.members == [0]
    c0 = QuorumClient("", 0, 1, 0, 5, store=store)
    assert c0.vote(json.loads(store.get(f"e{lh.epoch}")), 9, True) == COMMIT  # nothing taken


@pytest.mark.unit
def test_goodput_counts_another_groups_loss_apart_from_restarts():
    from stalwart.observe.goodput import account

    metrics = [{"step": s, "loss": 1.0, "step_time_s": 0.1, "time": 10.0 + 0.1 * s} for s in range(1, 11)]
    metrics[4]["step_time_s"] = 0.35  # step 5 redone after another group was lost
    events = [{"time": 10.0, "event": "launch"}, {"time": 10.5, "event": "group_step_redone", "step": 5},
              {"time": 10.8, "event": "group_transfer", "role": "source", "seconds": 0.05},
              {"time": 11.2, "event": "supervisor_exit"}]
    g = account(events, metrics)
    assert g["buckets"]["group_loss"] == pytest.approx(0.25 + 0.05)
    assert g["buckets"]["productive"] == pytest.approx(10 * 0.1)
    assert g["buckets"]["restart"] == 0 and not g["failures"]


@pytest.mark.unit
def test_a_rank_waiting_on_another_group_is_allowed_twice_the_progress_timeout():
    from stalwart.ft.detect import Beat, check_heartbeat

    def beat(peers, now):
        return Beat(0, 0, 29, 0, "train", progress_time=100.0, beat_time=now - 0.1, peers=peers)

    assert check_heartbeat(beat(False, 110.0), 0, 110.0, 0.0, 0, 3.0, 6.0, 900.0).kind == "hang"
    assert check_heartbeat(beat(True, 110.0), 0, 110.0, 0.0, 0, 3.0, 6.0, 900.0) is None
    assert check_heartbeat(beat(True, 113.0), 0, 113.0, 0.0, 0, 3.0, 6.0, 900.0).kind == "hang"
