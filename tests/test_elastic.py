"""training.elastic_exact: the same bits whatever the number of processes, and across a change of it."""

import pytest
import torch
from conftest import TINY_RUN, run_cli, step_losses

from stalwart.checkpoint.inspect import digest
from stalwart.errors import UserError
from stalwart.parallel.elastic import TreeAccumulator, blocks, check_elastic_layout, tree_sum


@pytest.mark.unit
def test_blocks_are_maximal_aligned_powers_of_two():
    assert blocks(0, 8) == [(0, 8)]
    assert blocks(0, 6) == [(0, 4), (4, 2)]
    assert blocks(3, 6) == [(3, 1), (4, 2)]
    assert blocks(2, 4) == [(2, 2)]
    assert blocks(5, 12) == [(5, 1), (6, 2), (8, 4)]


@pytest.mark.unit
@pytest.mark.parametrize("leaves", [1, 2, 4, 6, 8, 12])
def test_every_world_size_gives_the_same_bits(leaves):
    """The rank-local accumulation plus the exchange equals the one-process tree bit for bit, for every
    number of ranks dividing the leaves; a left-to-right sum (what plain accumulation does) differs."""
    gen = torch.Generator().manual_seed(leaves)
    values = [torch.randn(257, generator=gen) * 10 ** torch.randint(-3, 4, (257,), generator=gen) for _ in range(leaves)]
    reference = None
    for world in [w for w in range(1, leaves + 1) if leaves % w == 0]:
        nodes = {}
        for rank in range(world):
            acc = TreeAccumulator(leaves, rank, world)
            for v in values[acc.lo:acc.hi]:
                acc.push(v)
            assert [(lo, s) for lo, s, _ in acc._stack] == acc.mine  # one partial sum per block, no more
            nodes.update({(lo, s): v for lo, s, v in acc._stack})
        total = tree_sum(leaves, nodes)
        if reference is None:
            reference = total
        assert torch.equal(total, reference), world
    if leaves >= 4:
        plain = values[0].clone()
        for v in values[1:]:
            plain += v
        assert not torch.equal(plain, reference)  # the order matters at these magnitudes


@pytest.mark.unit
def test_uneven_split_and_sharded_layouts_are_refused_with_a_line():
    with pytest.raises(UserError, match="divide evenly"):
        TreeAccumulator(6, 0, 4)

    class Dims:
        dp_shard, tp, pp, cp, ep = 2, 1, 1, 1, 1

    with pytest.raises(UserError, match="dp_shard=2"):
        check_elastic_layout(Dims())


ELASTIC = [*TINY_RUN, "--parallelism.data_parallel", "replicate", "--training.elastic_exact", "true",
           "--training.global_batch", "8", "--training.micro_batch", "2", "--training.steps", "4",
           "--checkpoint.interval", "2", "--checkpoint.keep_last", "0", "--sample.max_new_tokens", "0"]


def _train(run_dir, nproc, *extra):
    return run_cli("train", "--run.dir", str(run_dir), *ELASTIC, "--nproc-per-node", str(nproc), *extra,
                   timeout=400)


@pytest.mark.e2e
def test_world_size_changes_keep_every_bit(tmp_path):
    """4 processes straight; 4 stopped at step 2 and resumed with 2; 2 stopped and resumed with 4; and one
    process: the same losses every step and the same final weights and optimizer state."""
    runs = {"4": tmp_path / "p4", "4->2": tmp_path / "p4to2", "2->4": tmp_path / "p2to4", "1": tmp_path / "p1"}
    _train(runs["4"], 4)
    _train(runs["4->2"], 4, "--training.stop_at_step", "2")
    _train(runs["4->2"], 2)
    _train(runs["2->4"], 2, "--training.stop_at_step", "2")
    _train(runs["2->4"], 4)
    _train(runs["1"], 1)
    ref = step_losses(runs["4"])
    assert sorted(ref) == [1, 2, 3, 4]
    final = runs["4"] / "checkpoints" / "step-4"
    for name, run in runs.items():
        assert step_losses(run) == ref, name
        for part in ("model.", "optim."):
            assert digest(run / "checkpoints" / "step-4", part) == digest(final, part), (name, part)
