"""The data cache: prepared text shared between runs, keyed by what defines it, built once and atomically."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from stalwart.data.cache import cache_root, cached, data_key, link_run_data
from stalwart.data.corpus import Corpus, DataError
from stalwart.data.prepare import INDEX, Source

pytestmark = pytest.mark.unit


def _corpus(tmp_path: Path) -> Corpus:
    d = tmp_path / "text"
    d.mkdir(exist_ok=True)
    for i in range(3):
        if not (d / f"doc{i}.txt").exists():
            (d / f"doc{i}.txt").write_text(f"document {i}\n" * 20)
    return Corpus(str(d))


def _key(corpus: Corpus, tok: str = "t" * 64, **over) -> str:
    settings = dict(fmt="auto", text_field="text", val_fraction=0.02, decode_errors="auto", shard_mb=8.0) | over
    return data_key([Source("text", "")], [corpus], tok, **settings)


def test_key_follows_inputs_settings_and_tokenizer(tmp_path):
    corpus = _corpus(tmp_path)
    key = _key(corpus)
    assert key == _key(_corpus(tmp_path))  # the same inputs: the same entry, from any run directory
    assert key != _key(corpus, tok="u" * 64)
    assert key != _key(corpus, val_fraction=0.1)
    doc = tmp_path / "text" / "doc1.txt"
    st = doc.stat()
    os.utime(doc, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched, same size
    assert _key(_corpus(tmp_path)) != key


def _build(calls: list, delay: float = 0.0, fail: bool = False):
    def build(folder: Path) -> None:
        calls.append(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "shard.bin").write_bytes(b"x" * 10)
        time.sleep(delay)
        if fail:
            raise KeyboardInterrupt  # killed midway
        (folder / INDEX).write_text("{}")
    return build


def test_concurrent_preparers_build_once_and_share(tmp_path):
    calls: list = []
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(cached(tmp_path, "k", _build(calls, 0.3))))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(how for _, how in results) == ["prepared", "waited", "waited"]
    assert {entry for entry, _ in results} == {tmp_path / "k"}
    assert cached(tmp_path, "k", _build(calls)) == (tmp_path / "k", "hit") and len(calls) == 1


def test_a_half_written_entry_is_never_used(tmp_path):
    calls: list = []
    with pytest.raises(KeyboardInterrupt):
        cached(tmp_path, "k", _build(calls, fail=True))
    assert not (tmp_path / "k").exists()  # only the partial folder, under another name
    entry, how = cached(tmp_path, "k", _build(calls))
    assert how == "prepared" and (entry / INDEX).is_file() and len(calls) == 2
    (tmp_path / "j").mkdir()  # a folder under the key's name without its index: rebuilt, not used
    assert cached(tmp_path, "j", _build(calls))[1] == "prepared" and (tmp_path / "j" / INDEX).is_file()


def test_run_link_and_a_changed_text_refused(tmp_path):
    a, b = tmp_path / "cache" / "aaaa", tmp_path / "cache" / "bbbb"
    a.mkdir(parents=True)
    b.mkdir()
    link = tmp_path / "run" / "data"
    link.parent.mkdir()
    link_run_data(link, a)
    link_run_data(link, a)  # a resume: nothing changes
    assert link.resolve() == a
    moved = tmp_path / "elsewhere" / "aaaa"
    moved.mkdir(parents=True)
    link_run_data(link, moved)  # the same key in a moved cache: followed
    assert link.resolve() == moved
    with pytest.raises(DataError, match="has changed since it began"):
        link_run_data(link, b)


def test_cache_root_setting_environment_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("STALWART_CACHE", str(tmp_path / "env"))
    assert cache_root("") == tmp_path / "env"
    assert cache_root(str(tmp_path / "set")) == tmp_path / "set"
    monkeypatch.delenv("STALWART_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root("") == tmp_path / "xdg" / "stalwart"
