"""Every package imports only what docs/architecture.md allows it (lazy imports too), the allow-lists
go one way down, and no file imports another in a circle."""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "stalwart"
LINE = re.compile(r"-\s+`([\w_]+)`\s+—\s+may import\s+(.*?)\s+—\s+\S")


def parse_allowed(text: str) -> dict[str, list[str]]:
    """package -> the packages it may import, from the block between ``<!-- imports`` and
    ``<!-- /imports -->``: one ``- `pkg` — may import `a` `b` — what it is`` line per package, in
    the document's order (bottom-up)."""
    block = text.split("<!-- imports:")[1].split("<!-- /imports -->")[0]
    out: dict[str, list[str]] = {}
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        m = LINE.match(line)
        assert m, f"docs/architecture.md: cannot read the imports line {line!r}"
        assert m.group(1) not in out, f"docs/architecture.md: `{m.group(1)}` is listed twice"
        names = re.findall(r"`([\w_]+)`", m.group(2))
        assert names or m.group(2) == "nothing", f"docs/architecture.md: {line!r} names no package (say 'nothing')"
        out[m.group(1)] = names
    return out


def allowed() -> dict[str, list[str]]:
    return parse_allowed((ROOT / "docs" / "architecture.md").read_text())


def packages() -> set[str]:
    """stalwart's packages and top-level modules (``errors``, ``paths``, ``__main__``, ...)."""
    return {p.stem if p.is_file() else p.name for p in PKG.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}


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


def forbidden(pairs: list[tuple[str, str, str]], allow: dict[str, list[str]]) -> list[str]:
    """The (importing package, imported package, file) triples the allow-lists do not permit."""
    return list(dict.fromkeys(f"{where}: {src} imports {dst}, which docs/architecture.md does not allow it"
                              for src, dst, where in pairs if src != dst and dst not in allow.get(src, ())))


def out_of_order(allow: dict[str, list[str]]) -> list[str]:
    """Allowed imports of a package listed at or below the importer (the list reads bottom-up)."""
    at = {name: i for i, name in enumerate(allow)}
    return [f"{src} may import {dst}, which is not listed above it" for src, dsts in allow.items() for dst in dsts
            if at.get(dst, len(at)) >= at[src]]


def package_pairs() -> list[tuple[str, str, str]]:
    out = []
    for f, mod in imports():
        parts = mod.split(".")[1:]
        # `from stalwart import __version__` reads the root package, which imports nothing of ours
        if parts and ((PKG / parts[0]).is_dir() or (PKG / f"{parts[0]}.py").is_file()):
            out.append((f.relative_to(PKG).with_suffix("").parts[0], parts[0], str(f.relative_to(ROOT))))
    return out


def test_every_package_is_listed_once():
    allow, have = allowed(), packages()
    assert have <= set(allow), f"add {sorted(have - set(allow))} to the imports list in docs/architecture.md"
    assert set(allow) <= have, f"{sorted(set(allow) - have)} in docs/architecture.md are not packages of stalwart/"
    named = {dst for dsts in allow.values() for dst in dsts}
    assert named <= have, f"docs/architecture.md allows imports of {sorted(named - have)}, which do not exist"


def test_every_import_is_allowed():
    bad = forbidden(package_pairs(), allowed())
    assert bad == [], "\n".join(bad)


def test_the_allow_lists_go_one_way_down():
    allow = allowed()
    assert _cycles({src: set(dsts) for src, dsts in allow.items()}) == []
    assert out_of_order(allow) == []


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
    """The rules are not vacuous: a forbidden import, allow-lists in a circle or out of order, and a
    file circle are reported."""
    allow = allowed()
    assert "train" not in allow["planner"] and "train" not in allow["sim"]
    assert forbidden([("planner", "train", "stalwart/planner/x.py"), ("train", "ft", "stalwart/train/y.py")],
                     allow) == ["stalwart/planner/x.py: planner imports train, which docs/architecture.md does "
                                "not allow it"]
    looped = parse_allowed("<!-- imports: x -->\n- `a` — may import nothing — base\n- `b` — may import `a` `c` — "
                           "middle\n- `c` — may import `b` — top\n<!-- /imports -->")
    assert looped == {"a": [], "b": ["a", "c"], "c": ["b"]}
    assert _cycles({src: set(dsts) for src, dsts in looped.items()}) == [["b", "c", "b"]]
    assert out_of_order(looped) == ["b may import c, which is not listed above it"]
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
