"""The layer order written in docs/architecture.md holds for every import in stalwart/ (lazy ones too),
and no package or file imports another in a circle."""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "stalwart"


def layers() -> dict[str, int]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- layers:")[1].split("<!-- /layers -->")[0]
    out = {}
    for line in block.splitlines():
        m = re.match(r"\s*(\d+)\.\s+(.*)", line)
        if m:
            for name in re.findall(r"`([\w_]+)`", m.group(2).split(" — ")[0]):
                out[name] = int(m.group(1))
    return out


def imports() -> list[tuple[Path, str]]:
    """(file, imported stalwart module) for every import statement, at any depth of the file."""
    out = []
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG).with_suffix("").parts
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = list(rel[:len(rel) - node.level])
                names = [".".join(["stalwart", *base, *(node.module or "").split(".")]).rstrip(".")]
            else:
                continue
            out += [(f, n) for n in names if n == "stalwart" or n.startswith("stalwart.")]
    return out


def violations(pairs: list[tuple[str, str]], order: dict[str, int]) -> list[str]:
    """(importing package, imported package) pairs that do not go strictly down a layer."""
    return [f"{src} imports {dst} (layer {order[dst]} >= {order[src]})" for src, dst in pairs
            if src != dst and order[dst] >= order[src]]


def package_pairs() -> list[tuple[str, str, str]]:
    out = []
    for f, mod in imports():
        parts = mod.split(".")[1:]
        # `from stalwart import __version__` reads the root package, which imports nothing of ours
        if parts and ((PKG / parts[0]).is_dir() or (PKG / f"{parts[0]}.py").is_file()):
            out.append((f.relative_to(PKG).with_suffix("").parts[0], parts[0], str(f.relative_to(ROOT))))
    return out


def test_every_package_has_a_layer():
    order = layers()
    packages = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert packages <= set(order), f"add {sorted(packages - set(order))} to the layer list in docs/architecture.md"


def test_no_import_goes_up_or_across_a_layer():
    order = layers()
    bad = [f"{where}: {v}" for src, dst, where in package_pairs() for v in violations([(src, dst)], order)]
    assert bad == [], "\n".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n, [n])
    return found


def test_no_file_imports_in_a_circle():
    modules = {".".join(("stalwart", *f.relative_to(PKG).with_suffix("").parts)).removesuffix(".__init__")
               for f in PKG.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for f, mod in imports():
        src = ".".join(("stalwart", *f.relative_to(PKG).with_suffix("").parts)).removesuffix(".__init__")
        while mod not in modules and "." in mod:
            mod = mod.rsplit(".", 1)[0]  # `from pkg.mod import name`: the module is pkg.mod
        if mod != src and mod in modules and not src.startswith(mod + "."):  # a package's own __init__
            edges.setdefault(src, set()).add(mod)
    assert _cycles(edges) == []


def test_the_checkers_catch_what_they_should():
    """The rules are not vacuous: an upward or sideways import and a circle are reported."""
    order = layers()
    assert violations([("config", "train"), ("checkpoint", "observe"), ("train", "ft")], order) == [
        f"config imports train (layer {order['train']} >= {order['config']})",
        f"checkpoint imports observe (layer {order['observe']} >= {order['checkpoint']})"]
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
