"""training.elastic_exact: the same bits whatever the number of processes, and across a change of it."""

import pytest
import torch
from conftest import TINY_RUN, assert_same_states, read_metrics, run_cli

from stalwart.checkpoint.inspect import digest
from stalwart.errors import UserError
from stalwart.metrics.records import read_jsonl
from stalwart.parallel.elastic import TreeAccumulator, blocks, check_elastic_layout, tree_grad_norm, tree_sum
from stalwart.paths import RunPaths


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
def test_uneven_split_and_split_models_are_refused_with_a_line():
    with pytest.raises(UserError, match="divide evenly"):
        TreeAccumulator(6, 0, 4)

    class Dims:
        dp_shard, tp, pp, cp, ep = 2, 1, 1, 1, 1

    check_elastic_layout(Dims())  # FSDP: every rank computes with the whole (gathered) model
    with pytest.raises(UserError, match="optimizer.name adamw"):
        check_elastic_layout(Dims(), "lamb")
    Dims.tp = 2
    with pytest.raises(UserError, match="tp=2"):
        check_elastic_layout(Dims())


@pytest.mark.unit
def test_gradient_norm_adds_in_the_same_order_whatever_the_split():
    """The elastic norm sums each dim-0 row, then each parameter's rows, then the parameters: rows are
    never split by FSDP, so its value is the whole tensors' (here: whole vs rows taken apart)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.empty(shape)) for shape in [(37, 19), (19,), (5, 3)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 10 ** torch.randint(-4, 4, p.shape, generator=gen)
    whole = tree_grad_norm(params)
    rows = [p.grad.float().square() for p in params]
    by_hand = torch.stack([torch.cat([r[i:i + 7].sum(dim=-1) if r.ndim > 1 else r[i:i + 7]
                                      for i in range(0, r.shape[0], 7)]).sum() for r in rows]).sum().sqrt()
    assert torch.equal(whole, by_hand)


ELASTIC = [*TINY_RUN, "--parallelism.data_parallel", "replicate", "--training.elastic_exact", "true",
           "--training.global_batch", "8", "--training.micro_batch", "2", "--training.steps", "4",
           "--checkpoint.interval", "2", "--checkpoint.keep_last", "0", "--sample.max_new_tokens", "0"]


def _train(run_dir, nproc, *extra):
    return run_cli("train", "--run.dir", str(run_dir), *ELASTIC, "--nproc-per-node", str(nproc), *extra,
                   timeout=400)


SHARD = ("--parallelism.data_parallel", "shard")
HSDP = ("--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2")


def _model_states(run) -> dict[int, tuple]:
    """step -> (loss, weights' and optimizer state's fingerprints): what must not depend on the number of
    processes (no component of the fingerprint does: the RNG states and the global data position are
    digested once each, however many ranks hold them)."""
    return {m["step"]: (m["loss"], m["fingerprint_parts"]["params"], m["fingerprint_parts"]["optim"])
            for m in read_metrics(run) if "loss" in m}


@pytest.mark.e2e
@pytest.mark.timeout(900)  # 5 launches, 6 sessions of up to 4 steps
def test_world_size_changes_keep_every_bit(tmp_path):
    """4 replicated processes straight (the reference); 2 FSDP processes stopped at step 2 and resumed by a
    second command as 4 in HSDP (2 replicas x 2 shards); one process; and 4 FSDP processes that lose a
    host and are shrunk to 2 by the supervisor (FSDP 4 -> 2 from the step-2 checkpoint): the same losses
    and weight and optimizer fingerprints every step, and the same final checkpoint."""
    runs = {"4": tmp_path / "p4", "fsdp 2->hsdp 4": tmp_path / "s2to4", "1": tmp_path / "p1",
            "host lost": tmp_path / "lost"}
    # The supervisor shrinks the job: two "hosts" of 2 processes; host 1 is lost at its first failure
    # (rank 3 killed in step 3) and no spare is left, so the job goes on with 2 processes from step 2.
    _train(runs["host lost"], 4, *SHARD, "--launch.max_restarts", "2", "--fault.exclude_after", "1",
           "--fault.host_size", "2", "--checkpoint.async_save", "false", "--fault.inject", "kill:rank=3,step=3")
    _train(runs["4"], 4)
    _train(runs["fsdp 2->hsdp 4"], 2, *SHARD, "--training.stop_at_step", "2")
    _train(runs["fsdp 2->hsdp 4"], 4, *HSDP)
    _train(runs["1"], 1)
    ref = _model_states(runs["4"])
    assert sorted(ref) == [1, 2, 3, 4]
    final = runs["4"] / "checkpoints" / "step-4"
    for name, run in runs.items():
        assert _model_states(run) == ref, name
        for part in ("model.", "optim."):
            assert digest(run / "checkpoints" / "step-4", part) == digest(final, part), (name, part)
    for name in ("fsdp 2->hsdp 4", "host lost"):
        assert any(e["event"] == "resumed" and e["step"] == 2 for e in read_jsonl(RunPaths(runs[name]).events)), name
    lost = read_jsonl(RunPaths(runs["host lost"]).events)
    assert [(e["kind"], e["rank"], e["host"], e["decision"]) for e in lost if e["event"] == "failure"] == [
        ("signal", 3, 1, "exclude")]
    shrunk = [e for e in lost if e["event"] == "excluded"]
    assert [(e["host"], e["shrunk_from"], e["nproc_per_node"], e["micro_batches_per_rank"], e["bitwise"])
            for e in shrunk] == [(1, 4, 2, [1, 2], True)]
    assert [e["world_size"] for e in lost if e["event"] == "start"] == [4, 2]
    # The whole fingerprint (RNG states and the global data position included) agrees at every step,
    # the steps the resumed run trained on 2 processes too; `stalwart compare` says identical and notes
    # the different numbers of processes.
    assert_same_states(runs["fsdp 2->hsdp 4"], runs["4"])
    compared = run_cli("compare", str(runs["fsdp 2->hsdp 4"]), str(runs["4"]))
    assert compared.stdout.startswith("identical: 4 common steps") and "note: the runs trained on different " \
        "numbers of processes" in compared.stdout, compared.stdout


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_an_elastic_resume_compares_identical_to_the_straight_run(tmp_path):
    """2 processes to step 2, then the same run resumed on 1: `stalwart compare` with the 1-process run
    says identical (exit 0; the data position is the global one), with a note on the process counts."""
    shrunk, straight = tmp_path / "2to1", tmp_path / "1"
    _train(shrunk, 2, "--training.stop_at_step", "2")
    _train(shrunk, 1)
    _train(straight, 1)
    assert_same_states(shrunk, straight)
    out = run_cli("compare", str(shrunk), str(straight)).stdout.splitlines()
    assert out == ["identical: 4 common steps (1-4) have the same state fingerprint",
                   f"note: the runs trained on different numbers of processes ({shrunk}: 2, then 1 from step 2; "
                   f"{straight}: 1); the state fingerprint does not depend on it, the gradient sums do unless "
                   "training.elastic_exact"], out
