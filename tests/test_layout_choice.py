"""The data-parallel layout is chosen for speed on one host: replicate when a full replica fits."""

import pytest

from stalwart.bench.throughput import reference_args
from stalwart.config.job import ParallelismConfig
from stalwart.models.llama import count_params
from stalwart.parallel.dims import ParallelDims, data_parallel_reason, replica_fits

pytestmark = pytest.mark.unit

GIB = 2**30


def test_auto_replicates_a_small_model_on_one_host_and_shards_otherwise():
    auto = ParallelismConfig()
    small = replica_fits(3_500_000, nnodes=1, memory_per_rank=4 * GIB)
    assert small
    degrees = ParallelDims.resolve(auto, 2, small).degrees()
    assert degrees == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}
    assert "replicated" in data_parallel_reason(auto, ParallelDims.resolve(auto, 2, small), small)
    # Two hosts, or a model whose state would take more than a quarter of a rank's memory: shard.
    assert not replica_fits(3_500_000, nnodes=2, memory_per_rank=4 * GIB)
    assert not replica_fits(8_000_000_000, nnodes=1, memory_per_rank=80 * GIB)
    sharded = ParallelDims.resolve(auto, 4, False)
    assert (sharded.dp_replicate, sharded.dp_shard) == (1, 4)
    assert "sharded over 4" in data_parallel_reason(auto, sharded, False)
    # Other parallelism in use: auto keeps FSDP for the data-parallel ranks.
    tp = ParallelDims.resolve(ParallelismConfig(tp=2), 4, True)
    assert (tp.dp_replicate, tp.dp_shard) == (1, 2)


def test_explicit_choices_win():
    assert ParallelDims.resolve(ParallelismConfig(data_parallel="shard"), 2, True).dp_shard == 2
    assert ParallelDims.resolve(ParallelismConfig(data_parallel="replicate"), 2, False).dp_replicate == 2
    explicit = ParallelDims.resolve(ParallelismConfig(dp_shard=2), 2, True)
    assert (explicit.dp_replicate, explicit.dp_shard) == (1, 2)
    assert "dp_replicate/dp_shard set" in data_parallel_reason(ParallelismConfig(dp_shard=2), explicit, True)


def test_the_benchmark_runs_the_reference_workload():
    a = reference_args()
    assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.vocab_size, a.max_seq_len, a.ffn_hidden) == (
        4, 256, 4, 4, 256, 256, 768)
    assert not a.tie_embeddings
    # 4 blocks of (4 d^2 attention + 3 d*768 SwiGLU + 2 d norms) + final norm + embedding + head.
    assert count_params(a) == 4 * (4 * 256**2 + 3 * 256 * 768 + 2 * 256) + 256 + 2 * 256 * 256
