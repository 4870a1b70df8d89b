"""The `stalwart serve` configuration tree: the inference engine, the HTTP server, the layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stalwart.config.core import ConfigError, option, section


@dataclass
class EngineConfig:
    block_size: int = option("Tokens per KV-cache block (the unit of allocation and of prefix reuse).", 16,
                             min=1, max=1024)
    kv_cache_mb: float = option("Memory for the KV cache in each process, MiB (keys and values of every "
                                "layer it holds).", 256.0, min=1.0)
    max_batch_tokens: int = option("Token budget of one forward pass: one per decoding sequence plus prompt "
                                   "chunks; a longer prompt is prefilled in chunks over several steps.", 512, min=1)
    max_seqs: int = option("Sequences in flight at most; more requests wait in the queue.", 64, min=1)
    max_queue: int = option("Requests waiting at most; beyond it the server answers 503.", 1024, min=1)
    prefix_caching: bool = option("Reuse the cached keys and values of a prompt prefix another request "
                                  "already computed.", True)
    pad_rows: int = option("Pad every forward pass to a multiple of this many tokens and sampled rows, so "
                           "matrix products take the same kernel path whatever the batch and a request's "
                           "output is bitwise the same alone or batched (CPU BLAS computes a row differently "
                           "when a matrix has 1-3 rows, or an odd number under 10 on two threads). 1 = off: "
                           "faster at small batches, equal tokens but not equal bits. 8 = bitwise.", 1, min=1)
    speculative: Literal["off", "ngram", "draft"] = option(
        "Speculative decoding (infer/speculative.py): 'ngram' proposes, for each decoding sequence, the tokens "
        "that followed the latest earlier occurrence of its last n-gram in its prompt and output (prompt "
        "lookup); 'draft' has a smaller model (engine.draft_model) propose them greedily. The model verifies "
        "them in the step's one forward pass. Greedy output is unchanged; sampled output keeps its "
        "distribution (not its exact tokens for a seed).", "off")
    draft_model: str = option("The draft model for speculative = draft: a run directory (its newest "
                              "checkpoint), one of its checkpoints, or a Hugging Face directory, with the served "
                              "model's tokenizer.", "")
    draft_window: int = option("Latest context tokens the draft model reads each step (it keeps no cache; "
                               "longer = better guesses, slower drafting).", 64, min=1, max=1 << 20)
    speculative_tokens: int = option("Tokens proposed per sequence and step when speculative decoding is on.", 4,
                                     min=1, max=32)
    speculative_ngram: int = option("Longest n-gram looked up (shorter ones are tried next, down to 1).", 3,
                                    min=1, max=16)
    decode_attention: Literal["auto", "grouped", "batched"] = option(
        "How a step attends its sequences decoding one token (infer/attention.py): 'grouped' takes one call per "
        "group of sequences whose cache contexts are evenly spaced, read in place (no padding: faster on CPU); "
        "'batched' takes one call per layer for all of them, their blocks gathered into one padded tensor with "
        "a length mask unless one strided view of the cache holds them all (the host launches one call, not one "
        "per group: for a GPU); 'auto' = batched on an accelerator, grouped on CPU. Greedy tokens are the same; "
        "log-probabilities may differ in the last bits. Bitwise mode (pad_rows > 1) attends each sequence "
        "alone.", "auto")
    dtype: Literal["float32", "bfloat16"] = option(
        "Weights and activations (`--dtype`). bfloat16 halves the bytes each token reads; on a CPU with AMX or "
        "avx512_bf16 its matrix products run in hardware (docs/serving.md, Precision).", "float32")
    quantize: Literal["none", "int8"] = option(
        "Quantized weights (`--quantize`): 'int8' = the decoder's linear layers and the output head in int8 per "
        "output channel, activations quantized per forward pass, computed by PyTorch's FBGEMM / oneDNN kernels "
        "(infer/quant.py); CPU only, with dtype float32 and tp 1. The same API, structured outputs and "
        "speculative decoding on top; docs/serving.md, Precision, has speed and log-likelihood against "
        "float32.", "none")
    device: Literal["auto", "cpu", "cuda"] = option(
        "Where the weights, the KV cache and the forward pass live ('auto' = cuda if available; a device this "
        "machine lacks is refused before any process starts; one GPU per process). Sampling runs on the host "
        "either way, so a seed draws the same tokens on any device. `--device` sets it too.", "auto")

    def __post_init__(self) -> None:
        if self.decode_attention == "batched" and self.pad_rows > 1:
            raise ConfigError("engine.decode_attention = batched gives attention batch-dependent shapes; bitwise "
                              "mode (engine.pad_rows > 1) attends each sequence alone: set one of them back")


@dataclass
class ServerConfig:
    host: str = option("Address to listen on; 127.0.0.1 (loopback only) unless you mean to expose it.",
                       "127.0.0.1")
    port: int = option("TCP port (0 = any free port, printed at start).", 8000, min=0, max=65535)
    model_name: str = option("Model name the API reports and accepts (default: the run directory's name).", "")


@dataclass
class LayoutConfig:
    tp: int = option("Tensor-parallel degree: attention heads and MLP units split over this many processes.",
                     1, min=1)
    pp: int = option("Pipeline-parallel degree: layers split into this many stages (processes).", 1, min=1)
    replicas: int = option("Independent copies of the model behind a least-loaded router.", 1, min=1)
    router: bool = option("Put the router in front of a single replica too (replicas = 1): the replica is started "
                          "again when it fails, and its streams resume on it once it is back.", False)
    routing: Literal["cache-aware", "least-load", "round-robin"] = option(
        "Where the router sends a request (serve/prefix.py): 'cache-aware' = the replica whose KV cache holds the "
        "longest prefix of its prompt unless that unbalances the load (see balance_abs, balance_rel), else the "
        "least loaded; 'least-load' = fewest requests in flight; 'round-robin' = each replica in turn.",
        "cache-aware")
    balance_abs: int = option("Cache-aware routing ignores the cache and takes the least loaded replica when the "
                              "busiest has more than this many requests in flight above the idlest ...", 8, min=0)
    balance_rel: float = option("... and more than this many times as many.", 1.5, min=1.0)
    prefill_replicas: int = option("Replicas that only compute prompts and hand each stream off after its first "
                                   "token to a decode replica (serve/disagg.py); with decode_replicas, instead "
                                   "of replicas. `--prefill-replicas` sets it too.", 0, min=0)
    decode_replicas: int = option("Replicas that decode the streams prefill replicas hand them (and serve requests "
                                  "that do not stream whole). `--decode-replicas` sets it too.", 0, min=0)


@dataclass
class EmbeddingsConfig:
    max_batch_tokens: int = option("Token budget of one embedding forward pass (texts x the longest of them, "
                                   "padding included): the batching thread takes every waiting request's texts "
                                   "up to it (always at least one text).", 4096, min=1)
    max_inputs: int = option("Texts (or token lists) one /v1/embeddings request may carry.", 2048, min=1)
    max_queue: int = option("Texts waiting to be embedded at most; beyond it the server answers 503.", 16384, min=1)


@dataclass
class RetrievalConfig:
    embedder: str = option("Retrieval-augmented completions: the embeddings model that embeds queries (a run "
                           "directory, one of its checkpoints, or a Hugging Face directory); the one each index "
                           "was built with.", "")
    index: list[str] = option("The indexes requests may name, NAME=ADDRESS each (ADDRESS: an index directory or a "
                              "postgresql:// URL); repeat --retrieval.index for several.", factory=list)
    keys: str = option("A JSON file {\"API key\": [\"tenant\", ...]}: a request's Bearer key may retrieve from "
                       "its tenants only.", "")
    max_k: int = option("Most sources one request may ask for (its retrieval.k).", 32, min=1, max=1000)
    reserve_tokens: int = option("Tokens kept for the answer of a chat request that sets no max_tokens when the "
                                 "retrieved sources are fitted into the context.", 256, min=1)

    def __post_init__(self) -> None:
        given = [n for n, v in (("embedder", self.embedder), ("index", self.index), ("keys", self.keys)) if v]
        if given and len(given) != 3:
            missing = [n for n in ("embedder", "index", "keys") if n not in given]
            raise ConfigError(f"retrieval.{given[0]} needs retrieval.{', retrieval.'.join(missing)} too "
                              "(the query embedder, NAME=ADDRESS indexes and the API keys file go together)")
        names = set()
        for item in self.index:
            name, sep, address = item.partition("=")
            if not sep or not name or not address:
                raise ConfigError(f"retrieval.index {item[:60]!r}: expected NAME=ADDRESS (an index directory or "
                                  "a postgresql:// URL)")
            if name in names:
                raise ConfigError(f"retrieval.index: the name {name!r} is given twice")
            names.add(name)

    @property
    def indexes(self) -> dict[str, str]:
        """Index name -> address."""
        return dict(item.split("=", 1) for item in self.index)


@dataclass
class ServeConfig:
    engine: EngineConfig = section(EngineConfig, "The batched, KV-cached inference engine.")
    server: ServerConfig = section(ServerConfig, "The OpenAI-compatible HTTP server.")
    layout: LayoutConfig = section(LayoutConfig, "How the model is partitioned and replicated.")
    embeddings: EmbeddingsConfig = section(EmbeddingsConfig, "Serving an embeddings model (/v1/embeddings).")
    retrieval: RetrievalConfig = section(RetrievalConfig, "Retrieval-augmented completions (serve/rag.py).")

    def __post_init__(self) -> None:
        if self.engine.max_batch_tokens < self.engine.max_seqs:
            raise ConfigError(f"engine.max_batch_tokens ({self.engine.max_batch_tokens}) must be at least "
                              f"engine.max_seqs ({self.engine.max_seqs}): every sequence decodes a token a step")
        if (self.engine.speculative == "draft") != bool(self.engine.draft_model):
            raise ConfigError("engine.speculative = draft and engine.draft_model go together: give both or neither")
        if self.engine.quantize != "none" and (self.engine.dtype != "float32" or self.layout.tp > 1):
            raise ConfigError(f"engine.quantize = {self.engine.quantize} takes float32 activations and whole weights "
                              "in each process: set engine.dtype = float32 and layout.tp = 1")
        layout = self.layout
        if bool(layout.prefill_replicas) != bool(layout.decode_replicas):
            raise ConfigError("layout.prefill_replicas and layout.decode_replicas go together: give both (at least "
                              "1 each) or neither")
        if layout.prefill_replicas:
            if layout.replicas not in (1, layout.prefill_replicas + layout.decode_replicas):
                raise ConfigError(f"layout.replicas ({layout.replicas}) with prefill and decode replicas: leave it "
                                  f"out (they make {layout.prefill_replicas + layout.decode_replicas})")
            if layout.tp * layout.pp > 1:
                raise ConfigError("prefill/decode replicas hand keys and values between one-process replicas: "
                                  "layout.tp and layout.pp must be 1")
            layout.replicas = layout.prefill_replicas + layout.decode_replicas
        if self.retrieval.index and (layout.replicas > 1 or layout.router):
            raise ConfigError("retrieval is served by one replica without the router (which does not pass API keys "
                              "on): leave layout.replicas at 1 and layout.router off")
