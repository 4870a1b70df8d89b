"""The runtime owns the device and the backend: its choices, its one-line refusals, and a walk of the
source that fails on a backend name or device string written anywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from stalwart.errors import UserError
from stalwart.runtime.device import (
    HOST,
    DeviceUnavailable,
    backend_for,
    check_device,
    is_accelerator,
    resolve_device,
)

pytestmark = pytest.mark.unit

PKG = Path(__file__).resolve().parents[1] / "stalwart"
# The runtime decides; the config declares the choices users may write.
OWNERS = ("runtime", "config")
BACKENDS = {"gloo", "nccl", "mpi", "ucc", "xccl", "hccl"}
DEVICE_TYPES = {"cpu", "cuda", "xpu", "mps", "hpu"}
# Calls whose positional arguments are devices or backends.
DEVICE_CALLS = {"device", "Generator", "init_device_mesh", "DeviceMesh", "init_process_group", "new_group", "to",
                "empty", "zeros", "ones", "full", "randn", "rand", "randint", "arange", "tensor"}
DEVICE_WORDS = ("device", "backend")


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_device_string(text: str) -> bool:
    head = text.split(":", 1)[0]
    return head in DEVICE_TYPES and (text == head or text[len(head) + 1:].isdigit())


def _is_backend_string(text: str) -> bool:
    """``gloo``, or a per-device spec such as ``cpu:gloo,cuda:nccl``."""
    parts = [p.split(":")[-1] for p in text.split(",")]
    return bool(parts) and all(p in BACKENDS for p in parts)


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def findings(source: str) -> list[tuple[int, str]]:
    """(line, literal) of every backend name anywhere in code, and every device string used as a device:
    a call's device argument, a ``device=``/``backend=`` keyword or default, a comparison with a
    device's ``.type``, ``str(device).startswith(...)``. Docstrings and messages are not code."""
    tree = ast.parse(source)
    out: list[tuple[int, str]] = []
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and _literal(n.body[0].value) is not None}
    formatted = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        text = _literal(node)
        if text is not None and id(node) not in docstrings and id(node) not in formatted and _is_backend_string(text):
            out.append((node.lineno, text))
        if isinstance(node, ast.Call):
            candidates = []
            if _name(node.func) in DEVICE_CALLS:
                candidates += node.args
            if _name(node.func) == "startswith":
                candidates += node.args
            candidates += [k.value for k in node.keywords if k.arg and k.arg.endswith(DEVICE_WORDS)]
            out += [(c.lineno, _literal(c)) for c in candidates if _literal(c) and _is_device_string(_literal(c))]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_name(s) == "type" or any(w in _name(s) for w in DEVICE_WORDS) for s in sides):
                out += [(s.lineno, _literal(s)) for s in sides if _literal(s) and _is_device_string(_literal(s))]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults \
                + node.args.kw_defaults
            for arg, default in zip(args, defaults):
                if default is not None and arg.arg.endswith(DEVICE_WORDS) and _literal(default) \
                        and _is_device_string(_literal(default)):
                    out.append((default.lineno, _literal(default)))
    return sorted(set(out))


def test_no_backend_or_device_literal_outside_the_runtime():
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        if f.relative_to(PKG).parts[0] in OWNERS:
            continue
        bad += [f"{f.relative_to(PKG.parent)}:{line}: {text!r}" for line, text in findings(f.read_text())]
    assert bad == [], "name devices and backends through stalwart.runtime:\n" + "\n".join(bad)


def test_the_walk_catches_what_it_should():
    src = '''
"""A docstring may say gloo and cpu."""
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
dist.init_process_group(backend="cpu:gloo,cuda:nccl")
x = torch.zeros(3, device="cuda:1")
g = torch.Generator(device="cpu")
if t.device.type == "cuda":
    pass
ok = str(device).startswith("cuda")
def f(device="cpu"):
    raise ValueError(f"not on {'cpu'}")
cause = Cause("cpu", "CPU")
presets = {"cpu": 1}
'''
    assert findings(src) == [(5, "gloo"), (6, "cpu:gloo,cuda:nccl"), (7, "cuda:1"), (8, "cpu"), (9, "cuda"),
                             (11, "cuda"), (12, "cpu")]


def test_auto_and_cpu_resolve_to_the_host_without_cuda():
    assert resolve_device("cpu") == HOST
    if not torch.cuda.is_available():
        assert resolve_device("auto") == HOST
        assert check_device("auto") == HOST.type


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot happen")
def test_a_device_the_machine_lacks_is_one_user_error_naming_the_setting():
    with pytest.raises(DeviceUnavailable, match=r"^--device cuda: this machine has no CUDA device .*cpu or auto$"):
        resolve_device("cuda")
    with pytest.raises(DeviceUnavailable, match="training.device cuda"):
        check_device("cuda", 2, "training.device")
    with pytest.raises(UserError, match=r"--device must be one of auto, cpu, cuda \(got 'tpu'\)"):
        check_device("tpu")


def test_backends_follow_the_device():
    assert backend_for(HOST) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"  # host tensors keep gloo beside NCCL
    assert not is_accelerator(HOST) and is_accelerator(torch.device("cuda", 0))


def test_a_store_port_is_free_and_outside_the_range_connections_draw_from():
    """A job's store port is chosen seconds before rank 0 binds it: no connection opened in between may
    take it, so it is drawn below the ephemeral range, for the agent's workers too."""
    import socket

    from torch.distributed.elastic.rendezvous import api as rdzv_api

    from stalwart.launch.agent import patched_agent
    from stalwart.runtime.settings import LOOPBACK, _lowest_ephemeral_port, free_port

    low = _lowest_ephemeral_port()
    ports = {free_port(LOOPBACK) for _ in range(20)} | {free_port() for _ in range(20)}
    assert len(ports) > 30 and all(10000 <= p < low for p in ports), sorted(ports)
    for port in ports:  # each is free now
        with socket.socket() as s:
            s.bind((LOOPBACK, port))
    torch_own = rdzv_api.get_free_port
    with patched_agent(object):
        assert rdzv_api.get_free_port is free_port
    assert rdzv_api.get_free_port is torch_own
