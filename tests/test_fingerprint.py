"""The state fingerprint: every changed bit changes it, shards add up to the whole tensor whatever the
layout, replicas count once; `stalwart compare` names the first differing step and tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stalwart.cli import compare
from stalwart.errors import UserError
from stalwart.train.fingerprint import combine, read_tensor_sums, whole
from stalwart.train.word_sums import MASK, int_sum

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_every_single_bit_flip_changes_the_sum(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(257, generator=g) * 100).to(dtype)
    base = int(int_sum(t))
    raw = t.clone().view(torch.uint8)
    for byte in (0, 1, raw.numel() // 2, raw.numel() - 1):
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            assert int(int_sum(flipped.view(dtype))) != base, (dtype, byte, bit)


def test_negative_zero_and_nan_payloads_are_told_apart():
    assert int(int_sum(torch.tensor([0.0]))) != int(int_sum(torch.tensor([-0.0])))
    a = torch.tensor([float("nan")])
    b = a.view(torch.int32).add(1).view(torch.float32)  # another NaN payload: equal for every float test
    assert int(int_sum(a)) != int(int_sum(b))


def _pieces(name: str, t: torch.Tensor, parts: int) -> list[list]:
    """``parts`` ranks' dim-0 shards of ``t`` as (name, offset, sum): what FSDP ranks contribute."""
    out, start = [], 0
    for chunk in torch.tensor_split(t, parts):
        offset = ",".join(map(str, [start] + [0] * (t.dim() - 1)))
        at = (start,) + (0,) * (t.dim() - 1)
        out.append([(name, offset, int(int_sum(chunk, tuple(t.shape), at)))])
        start += chunk.shape[0]
    return out


def test_sharded_replicated_and_single_layouts_give_one_value():
    w = torch.randn(10, 3)
    single = combine([{"pieces": [("params/w", "0,0", int(int_sum(w)))], "rng": "r", "data": "d"}])
    shards = combine([{"pieces": p, "rng": "r", "data": "d"} for p in _pieces("params/w", w, 3)])
    replicas = combine([{"pieces": [("params/w", "0,0", int(int_sum(w)))], "rng": "r", "data": "d"}] * 4)
    assert single[0] == shards[0] == replicas[0] == {"params/w": int(int_sum(w)) & MASK}
    assert single[1]["params"] == shards[1]["params"] == replicas[1]["params"]
    assert single[1]["rng"] == replicas[1]["rng"]  # identical RNG states on every replica count once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64])
def test_pieces_at_any_offset_add_up_to_the_whole(dtype):
    """Words are laid over the whole tensor's flat order, so pieces cut anywhere (rows of odd length,
    inner-dimension shards out of step with the words, one element) sum to the whole's value."""
    w = (torch.randn(7, 5, 3, generator=torch.Generator().manual_seed(1)) * 50).to(dtype)
    want = int(int_sum(w)) & MASK
    cuts = [((0, 3), (0, 5), (0, 3)), ((3, 7), (0, 5), (0, 3))], \
           [((0, 7), (0, 2), (0, 3)), ((0, 7), (2, 5), (0, 3))], \
           [((0, 4), (0, 5), (0, 1)), ((0, 4), (0, 5), (1, 3)), ((4, 7), (0, 5), (0, 3))], \
           [((i, i + 1), (j, j + 1), (0, 3)) for i in range(7) for j in range(5)]
    for pieces in cuts:
        got = 0
        for ranges in pieces:
            piece = w[tuple(slice(a, b) for a, b in ranges)]
            got += int(int_sum(piece, tuple(w.shape), tuple(a for a, _ in ranges)))
        assert got & MASK == want, (dtype, pieces[:2])


def test_each_component_moves_the_whole():
    base = {"pieces": [("params/w", "0", 5), ("optim/w/exp_avg", "0", 7)], "rng": "r", "data": "d"}
    ref = whole(combine([base])[1])
    for change in ({"pieces": [("params/w", "0", 6), ("optim/w/exp_avg", "0", 7)]},
                   {"pieces": [("params/w", "0", 5), ("optim/w/exp_avg", "0", 8)]}, {"rng": "s"}, {"data": "e"}):
        assert whole(combine([{**base, **change}])[1]) != ref, change


def _run(tmp: Path, name: str, fps: dict[int, tuple[str, dict, dict[str, int]]]) -> Path:
    run = tmp / name
    run.mkdir()
    lines, sums = [], [json.dumps({"names": sorted(next(iter(fps.values()))[2])})]
    for step, (fp, parts, tensors) in fps.items():
        lines.append(json.dumps({"step": step, "loss": 1.0, "fingerprint": fp, "fingerprint_parts": parts}))
        sums.append(json.dumps({"step": step, "sums": [f"{v:08x}" for _, v in sorted(tensors.items())]}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "fingerprints.jsonl").write_text("\n".join(sums) + "\n")
    return run


def test_compare_names_the_first_step_and_tensor(tmp_path, capsys):
    same = {"params/a": 1, "params/b": 2}
    a = _run(tmp_path, "a", {1: ("x1", {"params": "p1"}, same), 2: ("x2", {"params": "p2"}, same),
                             3: ("x3", {"params": "p3"}, same)})
    b = _run(tmp_path, "b", {1: ("x1", {"params": "p1"}, same), 2: ("y2", {"params": "q2"}, {**same, "params/b": 3}),
                             3: ("y3", {"params": "q3"}, same)})
    assert compare.main([str(a), str(a)]) == 0
    assert compare.main([str(a), str(b), "--tensors"]) == 1
    out = capsys.readouterr().out
    assert "first at step 2 (params;" in out and "first tensor: params/b" in out, out
    assert read_tensor_sums(b / "fingerprints.jsonl")[2]["params/b"] == 3
    with pytest.raises(UserError, match="no run directory"):
        compare.main([str(a), str(tmp_path / "missing")])


def test_the_data_component_is_the_global_position_whatever_the_number_of_ranks():
    """Every rank's loader holds the global data position: 1, 2 or 4 ranks give one ``data`` digest (an
    elastic resume compares identical); a rank whose position differs changes it."""
    one = {"pieces": [("params/w", "0", 5)], "rng": "r", "data": "d"}
    parts = [combine([one] * n)[1] for n in (1, 2, 4)]
    assert parts[0] == parts[1] == parts[2]
    assert combine([one, {**one, "data": "e"}])[1]["data"] != parts[0]["data"]


def test_compare_notes_runs_on_different_numbers_of_processes(tmp_path, capsys):
    same = {"params/a": 1}
    fps = {1: ("x1", {"params": "p1", "data": "d1"}, same), 2: ("x2", {"params": "p2", "data": "d2"}, same)}
    a, b = _run(tmp_path, "a", fps), _run(tmp_path, "b", fps)
    starts = {a: [(0, 2), (1, 1)], b: [(0, 1), (1, 1)]}  # a: 2 processes, resumed at step 1 on 1
    for run, rows in starts.items():
        (run / "events.jsonl").write_text("".join(json.dumps({"time": 1.0 + i, "event": "start", "step": st,
                                                              "world_size": n}) + "\n"
                                                  for i, (st, n) in enumerate(rows)))
    assert compare.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("identical: 2 common steps") and out[1] == (
        f"note: the runs trained on different numbers of processes ({a}: 2, then 1 from step 1; {b}: 1); the "
        "state fingerprint does not depend on it, the gradient sums do unless training.elastic_exact")
    assert compare.main([str(b), str(b)]) == 0 and len(capsys.readouterr().out.splitlines()) == 1


def test_replicas_share_the_work_and_every_piece_has_one_owner():
    from stalwart.train.fingerprint import assign_owners

    shared = [("params/a", "0"), ("params/b", "0"), ("params/c", "0"), ("params/d", "0")]
    owned = assign_owners({0: shared, 1: shared, 2: [("params/e", "0")]})
    assert sorted(len(v) for v in owned.values()) == [1, 2, 2] and owned[2] == [0]
    assert sorted(shared[i] for r in (0, 1) for i in owned[r]) == sorted(shared)  # each exactly once


def test_one_element_tensors_read_together_equal_their_own_sums():
    from stalwart.train.word_sums import piece_sums

    g = torch.Generator().manual_seed(3)
    ts = [torch.tensor(3.5), torch.randn(5, 4, generator=g), torch.tensor([7], dtype=torch.int64),
          torch.tensor(-1.25, dtype=torch.bfloat16), torch.tensor([200], dtype=torch.uint8), torch.randn(3, generator=g)]
    assert piece_sums(ts).tolist() == [int(int_sum(t)) for t in ts]


def test_bins_are_balanced_and_the_same_for_any_order_of_names():
    from stalwart.train.fingerprint import assign_bins, param_of

    sizes = {f"layers.{i}.{w}": n for i in range(4) for w, n in (("wq", 64), ("w1", 192), ("norm", 1))}
    sizes.update({"tok_embeddings.weight": 64, "output.weight": 64})
    bins = assign_bins(sizes, 4)
    assert bins == assign_bins(dict(reversed(list(sizes.items()))), 4)  # pure: depends on names and sizes
    load = [sum(n for name, n in sizes.items() if bins[name] == b) for b in range(4)]
    assert max(load) - min(load) <= 64 and sum(load) == sum(sizes.values()), load
    assert assign_bins(sizes, 1) == dict.fromkeys(sizes, 0)
    assert param_of("params/layers.0.wq") == "layers.0.wq" == param_of("optim/layers.0.wq/exp_avg")


def test_a_sampled_fingerprint_catches_a_flipped_bit_within_its_turns(tmp_path):
    """Each logged step sums one bin of the weights and optimizer state, in turn; a bit flipped in a
    tensor changes the first fingerprint whose bin holds it, at most `sample` logged steps later, and
    the last step's `fingerprint_full` covers everything. The per-tensor file leaves the others null."""
    from stalwart.train.fingerprint import Fingerprinter

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()

    def stamps(tmp: Path, flip: str | None, at: int) -> tuple[list[dict], Path]:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        fp = Fingerprinter(model, opt, lambda: {"pos": 0}, 1, 8, tmp / "fingerprints.jsonl", True, sample=4)
        out = []
        try:
            for step in range(1, 9):
                if flip and step == at:
                    with torch.no_grad():
                        dict(model.named_parameters())[flip].view(-1)[3].view(torch.int32).bitwise_xor_(1 << 5)
                rec: dict = {}
                fp.maybe_stamp(step, rec)
                out.append(rec)
        finally:
            model.load_state_dict(state)
        return out, tmp / "fingerprints.jsonl"

    tmp = tmp_path
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    base, sums_file = stamps(tmp / "a", None, 0)
    assert "fingerprint_full" in base[-1] and all("fingerprint_full" not in r for r in base[:-1])
    per_step = read_tensor_sums(sums_file)
    names = set().union(*per_step.values())
    assert len(names) == 32 and all(0 < len(per_step[s]) < 32 for s in range(1, 8)) and len(per_step[8]) == 32
    assert set().union(*(per_step[s] for s in range(1, 5))) == names  # every tensor within 4 logged steps
    for flip in ("0.weight", "1.bias", "3.weight"):
        changed, _ = stamps(tmp / "b", flip, 2)
        first = next(i + 1 for i, (x, y) in enumerate(zip(base, changed)) if x["fingerprint"] != y["fingerprint"])
        assert 2 <= first <= 5, (flip, first)
        assert changed[-1]["fingerprint_full"] != base[-1]["fingerprint_full"]
        (tmp / "b" / "fingerprints.jsonl").unlink()


def test_compare_sees_a_difference_only_the_last_steps_whole_state_shows(tmp_path, capsys):
    same = {"params/a": 1}
    a = _run(tmp_path, "a", {1: ("x1", {"params": "p1"}, same), 2: ("x2", {"params": "p2"}, same)})
    b = _run(tmp_path, "b", {1: ("x1", {"params": "p1"}, same), 2: ("x2", {"params": "p2"}, same)})
    for run, full in ((a, "f"), (b, "g")):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        lines[-1] = json.dumps({**json.loads(lines[-1]), "fingerprint_full": full})
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert compare.main([str(a), str(b)]) == 1
    assert "first at step 2 (fingerprint_full" in capsys.readouterr().out


def test_replicas_share_each_bins_work_by_size():
    from stalwart.train.fingerprint import assign_owners

    sizes = {"params/a": 100, "params/b": 60, "params/c": 50, "params/d": 10, "params/e": 100, "params/f": 1}
    bins = {"params/a": 0, "params/b": 0, "params/c": 0, "params/d": 0, "params/e": 1, "params/f": 1}
    shared = [(n, "0") for n in sizes]
    owned = assign_owners({0: shared, 1: shared}, lambda k: (bins[k[0]], sizes[k[0]]))
    load = {(b, r): sum(sizes[shared[i][0]] for i in owned[r] if bins[shared[i][0]] == b) for b in (0, 1) for r in (0, 1)}
    assert load == {(0, 0): 110, (0, 1): 110, (1, 0): 100, (1, 1): 1}, load  # a in 0 with d, b + c in 1
    assert sorted(shared[i] for r in (0, 1) for i in owned[r]) == sorted(shared)
