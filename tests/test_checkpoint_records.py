"""Tensor records read in place (``stalwart.checkpoint.records``): the same tensors ``torch.load`` gives,
crafted records refused without running anything, and the restore path really taking the fast route."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from stalwart.checkpoint.records import RecordError, tensor_from_record
from stalwart.checkpoint.safe_io import SafeLoadPlanner
from stalwart.checkpoint.verify import MemoryFileSystemReader, verify_checkpoint
from test_checkpoint_unit import saved_run, tiny

pytestmark = pytest.mark.unit


def _record(obj) -> memoryview:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return memoryview(bytearray(buf.getvalue()))


def _cases():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    yield "fp32", base
    yield "bf16", base.to(torch.bfloat16)
    yield "fp16", base.to(torch.float16)
    yield "int64", torch.randint(-5, 5, (7,), generator=g)
    yield "bool", base > 0
    yield "uint8", torch.arange(256, dtype=torch.uint8)
    yield "transposed", base.t()
    yield "slice_with_offset", base[2:5, 3:9]
    yield "strided", base[:, ::3]
    yield "zero_dim", torch.tensor(3.5)
    yield "empty", torch.empty(0, 4)
    yield "expanded", torch.ones(1, 5).expand(4, 5)


@pytest.mark.parametrize("name,tensor", list(_cases()), ids=[n for n, _ in _cases()])
def test_a_record_read_in_place_equals_torch_load(name, tensor):
    view = _record(tensor)
    got = tensor_from_record(view)
    want = torch.load(io.BytesIO(bytes(view)), weights_only=True)
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got, want) and torch.equal(got, tensor)
    if got.numel():  # in place: the tensor is a view of the record's bytes, not a copy
        base = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
        assert base <= got.untyped_storage().data_ptr() < base + len(view)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_record_that_is_not_a_plain_tensor_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "PWNED"
    with pytest.raises(pickle.UnpicklingError):
        tensor_from_record(_record(_Evil(marker)))
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match="not a tensor"):
        tensor_from_record(_record({"a": torch.ones(2)}))
    with pytest.raises(pickle.UnpicklingError, match="not a tensor"):
        tensor_from_record(_record(torch.nn.Parameter(torch.ones(2))))


def test_bytes_that_are_not_a_record_or_lie_about_their_storage_are_refused():
    with pytest.raises(RecordError, match="not a torch.save record"):
        tensor_from_record(memoryview(bytearray(b"\x00" * 200)))
    # A record whose pickle claims 255 elements of a 4-element storage (one byte patched in the stored,
    # uncompressed pickle: size tuple ``K\x04 \x85``): torch refuses to set the tensor up.
    view = _record(torch.arange(4, dtype=torch.float32))
    raw = bytes(view)
    assert raw.count(b"K\x04\x85q\x06") == 1
    lying = raw.replace(b"K\x04\x85q\x06", b"K\xff\x85q\x06")
    with pytest.raises(RecordError, match="does not fit its storage"):
        tensor_from_record(memoryview(bytearray(lying)))
    # Truncated storage bytes: the storage no longer fits in the buffer.
    with pytest.raises(RecordError):
        tensor_from_record(memoryview(bytearray(raw[: len(raw) // 2])))


def test_a_verified_restore_reads_every_tensor_in_place(tmp_path):
    m, _ = saved_run(tmp_path / "ckpt", steps=(2,))
    model, opt = tiny(seed=1)
    from test_checkpoint_unit import train_step

    train_step(model, opt, 1)  # the optimizer has state to be overwritten
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    files = verify_checkpoint(tmp_path / "ckpt" / "step-2", keep=True, rank=0)
    reader = MemoryFileSystemReader(files)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        files.check()
    finally:
        files.release()
    tensors = sum(1 for v in model_sd.values() if isinstance(v, torch.Tensor))
    assert reader.in_place >= tensors > 0
    reference, ref_opt = tiny()
    for s in (1, 2):
        train_step(reference, ref_opt, s)
    for k, v in reference.state_dict().items():
        assert torch.equal(model_sd[k], v), k
