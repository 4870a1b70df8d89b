"""`stalwart data prepare|inspect|pairs`: tokenize a corpus once into memory-mappable shards; describe one;
mine query/document pairs for an embeddings model."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from stalwart.config.arguments import ArgumentParser

USAGE = "usage: stalwart data {prepare,inspect,pairs} ...   (stalwart data prepare --help)"


def _prepare_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="stalwart data prepare", description=(
        "Tokenize text (files, directories, globs, JSONL, Parquet, a Hugging Face `datasets.save_to_disk` "
        "directory) with N worker processes into Megatron-style .bin/.idx token shards plus index.json. "
        "Re-running after an interruption keeps finished shards; the same inputs give the same bytes."))
    p.add_argument("--input", action="append", default=[], metavar="[NAME=]PATH",
                   help="a source (repeatable); NAME names it for data.mix (default: the path's stem). "
                        "None = the bundled corpus (this Python's standard library).")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--workers", type=int, default=1, help="tokenizer worker processes (default 1)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", default="", help="a tokenizer.json to use")
    tok.add_argument("--vocab-size", type=int, default=4096, help="train a byte-level BPE of this size (default)")
    p.add_argument("--tokenizer-train-mb", type=float, default=4.0, help="text used to train the BPE (MB)")
    p.add_argument("--format", choices=["auto", "text", "jsonl", "parquet"], default="auto")
    p.add_argument("--text-field", default="text", help="field holding the text in JSONL/Parquet/Arrow records")
    p.add_argument("--val-fraction", type=float, default=0.02, help="documents held out for validation, per source")
    p.add_argument("--decode-errors", choices=["auto", "strict", "replace"], default="auto")
    p.add_argument("--shard-mb", type=float, default=8.0, help="text per shard (MB); shards are the unit of work")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


class _Bar:
    """A rich progress bar over input bytes, with tokens/s, MB/s and the time remaining."""

    def __init__(self, enabled: bool) -> None:
        self.bar = None
        self.t0 = time.perf_counter()
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]prepare"), BarColumn(), TextColumn("{task.fields[info]}"),
                                TimeRemainingColumn())
            self.task = self.bar.add_task("prepare", total=None, info="")
            self.bar.start()
        self.first: dict | None = None
        self.printed = 0.0

    def __call__(self, s: dict) -> None:
        self.first = self.first or s
        dt = max(1e-9, time.perf_counter() - self.t0)
        mb = (s["bytes"] - self.first["bytes"]) / 1e6
        tps = (s["tokens"] - self.first["tokens"]) / dt
        info = (f"shards {s['shards']}/{s['shards_total']}  {s['bytes'] / 1e6:.1f}/{s['bytes_total'] / 1e6:.1f} MB  "
                f"{mb / dt:.2f} MB/s  {tps / 1e6:.2f}M tok/s")
        if self.bar is not None:
            self.bar.update(self.task, total=s["bytes_total"], completed=s["bytes"], info=info)
        elif s["shards"] == s["shards_total"] or time.perf_counter() - self.printed > 5.0:
            self.printed = time.perf_counter()
            print(f"prepare: {info}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _tokenizer(args, sources, out: Path):
    from stalwart.data.corpus import Corpus
    from stalwart.data.prepare import TOKENIZER
    from stalwart.data.tokenizer import load_tokenizer, train_on

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if (out / TOKENIZER).is_file():  # an interrupted prepare continues with its own tokenizer
        return load_tokenizer(out / TOKENIZER)
    corpora = [Corpus(s.path, args.format, args.text_field, args.val_fraction, args.decode_errors) for s in sources]
    return train_on(corpora, args.vocab_size, args.tokenizer_train_mb)


_FLAGS = {"data.path": "--input", "data.text_field": "--text-field", "data.decode_errors": "--decode-errors",
          "data.val_fraction": "--val-fraction", "data.tokenizer": "--tokenizer"}


def prepare_main(argv: list[str]) -> int:
    """Errors from the shared readers name the config fields; here they name this command's flags."""
    args = _prepare_parser().parse_args(argv)
    # the readers (numpy, tokenizers) only once the flags are parsed
    from stalwart.data.corpus import DataError

    try:
        return _prepare(args)
    except DataError as e:
        msg = str(e)
        for field, flag in _FLAGS.items():
            msg = msg.replace(field, flag)
        raise DataError(msg) from None


def _prepare(args: argparse.Namespace) -> int:
    from stalwart.atomic import output_dir
    from stalwart.data.corpus import DataError
    from stalwart.data.prepare import parse_inputs, prepare
    from stalwart.data.tokenizer import eos_id

    if args.workers < 1:
        raise DataError(f"--workers must be at least 1 (got {args.workers})")
    if not 0 <= args.val_fraction <= 0.5:
        raise DataError(f"--val-fraction must be within [0, 0.5] (got {args.val_fraction})")
    sources, out = parse_inputs(args.input), output_dir(args.out, "--out")
    tok = _tokenizer(args, sources, out)
    bar = _Bar(not args.no_progress)
    t0 = time.perf_counter()
    try:
        index = prepare(sources, out, tok, eos_id(tok), workers=args.workers, fmt=args.format,
                        text_field=args.text_field, val_fraction=args.val_fraction,
                        decode_errors=args.decode_errors, shard_mb=args.shard_mb, progress=bar)
    finally:
        bar.close()
    dt = time.perf_counter() - t0
    tokens = sum(s[split]["tokens"] for s in index["sources"] for split in ("train", "val"))
    print(f"prepared {out}: {len(index['sources'])} source(s), {tokens:,} tokens in {dt:.1f} s "
          f"(train with --data.path {out})")
    return 0


def inspect_main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart data inspect",
                       description="Sources, documents, tokens and shard checksums of a prepared dataset.")
    p.add_argument("dir")
    p.add_argument("--verify", action="store_true", help="recompute every shard's sha256 and compare")
    args = p.parse_args(argv)
    from stalwart.data.prepared import open_prepared

    data = open_prepared(args.dir)
    data.verify(full=args.verify)
    ix = data.index
    print(f"{data.root}: {ix['format']}, vocab {ix['vocab_size']}, eos {ix['eos_id']}, {ix['dtype']} tokens, "
          f"tokenizer sha256 {ix['tokenizer_sha256'][:16]}")
    for src in ix["sources"]:
        print(f"source {src['name']} ({src['path'] or 'bundled corpus'}):")
        for split in ("train", "val"):
            part = src[split]
            print(f"  {split}: {part['documents']:,} documents, {part['tokens']:,} tokens, {len(part['shards'])} shard(s)")
            for sh in part["shards"]:
                print(f"    {sh['name']}.bin  {sh['documents']:>8,} docs  {sh['tokens']:>12,} tokens  "
                      f"sha256 {sh['bin_sha256'][:16]}")
    print("checksums verified" if args.verify else "sizes checked (--verify to recompute checksums)")
    return 0


def pairs_main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart data pairs",
                       description="Mine docstring -> function pairs from Python sources into a pairs dataset for an "
                                   "embeddings model (train with --data.path OUT --training.objective contrastive "
                                   "--model.embed_dim N --data.seq_len SEQ_LEN). Writes OUT/train.jsonl and "
                                   "OUT/heldout.jsonl (the pairs of the held-out packages: retrieval evaluation).")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--root", default="", help="a directory of .py files (default: this Python's standard library)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per pair: half the query, half the document")
    p.add_argument("--held-out", type=int, default=10, help="percent of top-level packages held out (default 10)")
    p.add_argument("--no-names", action="store_true",
                   help="only docstring pairs (default: also a 'name' source: each function's name words -> its code)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", default="", help="a tokenizer.json to use")
    tok.add_argument("--vocab-size", type=int, default=4096, help="train a byte-level BPE of this size (default)")
    p.add_argument("--tokenizer-train-mb", type=float, default=4.0, help="text used to train the BPE (MB)")
    args = p.parse_args(argv)
    from stalwart.atomic import output_dir
    from stalwart.data.corpus import Corpus, DataError, default_corpus_root
    from stalwart.data.pairs import mine, split, write_dataset, write_jsonl
    from stalwart.data.tokenizer import eos_id, load_tokenizer, train_on

    if not 0 <= args.held_out <= 50:
        raise DataError(f"--held-out must be a percent within [0, 50] (got {args.held_out})")
    root = Path(args.root) if args.root else default_corpus_root()
    if not root.is_dir():
        raise DataError(f"--root {root} is not a directory")
    out = output_dir(args.out, "--out")
    t0 = time.perf_counter()
    pairs = mine(root)
    if len(pairs) < 4:
        raise DataError(f"--root {root}: only {len(pairs)} functions with docstrings found; give a larger tree")
    train, held = split(pairs, args.held_out)
    sources = {"docstring": (train, held)}
    if not args.no_names:
        sources["name"] = split(mine(root, "name"), args.held_out)
    tok = (load_tokenizer(args.tokenizer) if args.tokenizer
           else train_on([Corpus(args.root, decode_errors="replace")], args.vocab_size, args.tokenizer_train_mb))
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(held, out / "heldout.jsonl")
    write_dataset(sources, out, tok, eos_id(tok), args.seq_len)
    names = f" (+ {len(sources['name'][0]):,} name -> code pairs)" if "name" in sources else ""
    print(f"pairs {out}: {len(train):,} training pairs{names}, {len(held):,} held out "
          f"({len({p.module.split('.')[0] for p in held})} packages) from {root} in {time.perf_counter() - t0:.1f} s; "
          f"train with --data.path {out} --data.seq_len {args.seq_len} --training.objective contrastive "
          "--model.embed_dim 128")
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    commands = {"prepare": prepare_main, "inspect": inspect_main, "pairs": pairs_main}
    if argv[0] not in commands:
        print(f"stalwart data: unknown subcommand '{argv[0]}'. {USAGE}", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])
