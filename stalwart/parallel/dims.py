"""Parallel dimensions as one validated value object, and the named device mesh built from it.

Validation is pure (no process groups), so an impossible layout is rejected before any
communication starts, with the failed constraint and a valid alternative in the message.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.errors import UserError

# Mesh dimension order, outermost (slowest network tier) to innermost (fastest): pipeline stages
# talk least (point-to-point activations), replicas reduce once per step, FSDP gathers every layer,
# context parallel exchanges keys/values every layer, tensor parallel communicates inside every
# matmul and so must stay within a host (NVLink).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class LayoutError(UserError, ValueError):
    """An impossible parallel layout; the message names the constraint and an alternative."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# `data_parallel = auto` replicates when a rank's full training state is at most this share of its memory.
REPLICATE_MEMORY_SHARE = 0.25
# fp32 parameter + gradient + AdamW's two moments.
TRAINING_BYTES_PER_PARAM = 16


def replica_fits(n_params: int, nnodes: int, memory_per_rank: int) -> bool:
    """Whether a full replica of the training state fits each rank of a one-host job (pure)."""
    return nnodes == 1 and n_params * TRAINING_BYTES_PER_PARAM <= REPLICATE_MEMORY_SHARE * memory_per_rank


def replicates(cfg, replicate_fits: bool) -> bool:
    """Whether the ranks left to data parallelism replicate the model (rather than shard it)."""
    mode = getattr(cfg, "data_parallel", "shard")
    if mode == "auto":
        return replicate_fits and cfg.tp == cfg.pp == cfg.cp == getattr(cfg, "ep", 1) == 1
    return mode == "replicate"


def replicates_whole_model(dims: "ParallelDims") -> bool:
    """Whether the data-parallel ranks each hold the whole model and nothing else is split: the layout
    DDP's replicate serves (one bucketed gradient all-reduce that overlaps backward)."""
    return dims.dp_replicate > 1 and dims.dp_shard == dims.tp == dims.pp == dims.cp == dims.ep == 1


def data_parallel_reason(cfg, dims: "ParallelDims", replicate_fits: bool) -> str:
    """One line for the banner: how the data-parallel ranks hold the model, and why."""
    if dims.dp <= 1:
        return ""
    if replicates_whole_model(dims):
        how = "replicated (DDP: gradients all-reduced in buckets during backward)"
    elif dims.dp_shard == 1:
        how = "replicated (HSDP: gradients all-reduced)"
    else:
        how = f"sharded over {dims.dp_shard} ranks (FSDP)"
    mode = getattr(cfg, "data_parallel", "shard")
    if cfg.dp_replicate != 1 or cfg.dp_shard != -1:
        why = "parallelism.dp_replicate/dp_shard set"
    elif mode != "auto":
        why = f"parallelism.data_parallel = {mode}"
    elif replicates(cfg, replicate_fits):
        why = "auto: one host, and a full replica fits in a quarter of each rank's memory"
    elif not replicate_fits:
        why = "auto: more than one host, or a full replica would not fit comfortably"
    else:
        why = "auto: tp/pp/cp/ep in use"
    return f"data parallel: the model is {how} ({why}; --parallelism.data_parallel overrides)"


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    world_size: int
    ep: int = 1  # expert parallel: a split of dp_shard (experts sharded, tokens by all-to-all)

    @staticmethod
    def resolve(cfg, world_size: int, replicate_fits: bool = False) -> "ParallelDims":
        """Fill ``dp_shard = -1`` from the world size and check the product. ``cfg``: parallelism section;
        ``replicate_fits``: the job is on one host and a full replica fits each rank (for 'auto')."""
        dp_replicate, dp_shard = cfg.dp_replicate, cfg.dp_shard
        if replicates(cfg, replicate_fits) and dp_replicate == 1 and dp_shard == -1:
            other = cfg.tp * cfg.pp * cfg.cp
            if world_size % other == 0:
                dp_replicate, dp_shard = world_size // other, 1
        fixed = dp_replicate * cfg.tp * cfg.pp * cfg.cp
        if dp_shard == -1:
            if world_size % fixed:
                raise LayoutError(
                    f"parallelism: dp_replicate*tp*pp*cp = {fixed} does not divide the world size {world_size}; "
                    f"use degrees whose product divides {world_size} (divisors: {_divisors(world_size)})")
            dp_shard = world_size // fixed
        if dp_shard < 1:
            raise LayoutError(f"parallelism.dp_shard must be >= 1 or -1 (auto), got {dp_shard}")
        product = fixed * dp_shard
        if product != world_size:
            raise LayoutError(
                f"parallelism: dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * tp({cfg.tp}) * "
                f"pp({cfg.pp}) * cp({cfg.cp}) = {product}, but the world size is {world_size}; set "
                f"parallelism.dp_shard = -1 to fill in the rest, or launch {product} processes")
        ep = getattr(cfg, "ep", 1)
        if dp_shard % ep:
            raise LayoutError(f"parallelism.ep = {ep} must divide parallelism.dp_shard = {dp_shard} (expert parallel "
                              f"ranks are a subset of the FSDP ranks); valid ep degrees: {_divisors(dp_shard)}")
        if ep > 1 and cfg.cp > 1:
            raise LayoutError("parallelism.ep: expert parallel together with cp > 1 is not supported; use one of them")
        if ep > 1 and dp_replicate > 1:
            raise LayoutError("parallelism.ep: expert parallel together with dp_replicate > 1 (HSDP) is not "
                              "supported; use dp_shard for the data-parallel ranks")
        return ParallelDims(dp_replicate, dp_shard, cfg.tp, cfg.pp, cfg.cp, world_size, ep)

    def check_model(self, n_heads: int, n_kv_heads: int, n_layers: int, seq_len: int,
                    virtual_stages: int = 1, n_experts: int = 0) -> None:
        """Constraints that depend on the model shape (``n_experts`` = 0: a dense model)."""
        if self.ep > 1 and not n_experts:
            raise LayoutError(f"parallelism.ep = {self.ep} needs a mixture-of-experts model and this one is dense; "
                              "use a sparse flavor (e.g. --model.flavor debug-moe) or --model.moe_experts N")
        if self.ep > 1 and n_experts % self.ep:
            raise LayoutError(f"parallelism.ep = {self.ep} must divide the {n_experts} experts; valid ep degrees: "
                              f"{[d for d in _divisors(n_experts) if self.dp_shard % d == 0]}")
        if n_experts and self.cp > 1:
            raise LayoutError("parallelism.cp > 1 with a mixture-of-experts model is not supported (the balance "
                              "statistics are per sequence); use dp_shard or ep")
        if n_heads % self.tp or n_kv_heads % self.tp:
            ok = [d for d in _divisors(n_kv_heads) if n_heads % d == 0]
            raise LayoutError(
                f"parallelism.tp = {self.tp} must divide both the attention heads ({n_heads}) and the key/value "
                f"heads ({n_kv_heads}); valid tp degrees: {ok}")
        stages = self.pp * virtual_stages
        if stages > n_layers:
            raise LayoutError(
                f"parallelism.pp = {self.pp} with {virtual_stages} virtual stage(s) needs {stages} stages but the "
                f"model has only {n_layers} layers; use pp <= {n_layers // virtual_stages}")
        if seq_len % (2 * self.cp) and self.cp > 1:
            raise LayoutError(
                f"parallelism.cp = {self.cp}: the sequence length {seq_len} must be divisible by 2*cp = "
                f"{2 * self.cp} (each rank holds two balanced chunks); valid cp degrees: "
                f"{[d for d in _divisors(seq_len // 2) if d > 1][:8]}")

    @property
    def dp(self) -> int:
        """Data-parallel size: how many distinct batches a step consumes."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks over which parameters are sharded (cp ranks share the FSDP mesh: same weights)."""
        return self.dp_shard * self.cp

    def degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
                "cp": self.cp, "tp": self.tp}

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (row-major in MESH_ORDER, tp fastest)."""
        coords = {}
        rest = rank
        for name in reversed(MESH_ORDER):
            size = self.degrees()[name]
            coords[name] = rest % size
            rest //= size
        return coords

    def dp_rank(self, rank: int) -> int:
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in {**self.degrees(), "ep": self.ep}.items() if v > 1]
        return " x ".join(parts) if parts else "single process"


def virtual_stages(cfg, dims: ParallelDims) -> int:
    """Pipeline stages per rank implied by the schedule (1 without pipelining). ``cfg``: parallelism."""
    if dims.pp == 1:
        return 1
    from stalwart.parallel.pipeline import stages_per_rank

    return stages_per_rank(cfg.pp_schedule, cfg.pp_virtual_stages)


@dataclass
class Meshes:
    """The world mesh and the views each technique needs, built once and passed explicitly."""

    world: object  # DeviceMesh over MESH_ORDER
    dp: object  # 1-D: ranks that see different batches (replicate x shard)
    fsdp: object  # FSDP mesh: 1-D (shard[, cp]) or 2-D (replicate, shard[, cp]) for HSDP
    dims: ParallelDims
    ep: object = None  # expert-parallel ranks (inner part of dp_shard); None without expert parallel
    expert_fsdp: object = None  # the rest of dp_shard: FSDP mesh of the sharded experts

    def __getitem__(self, name: str):
        return self.world[name]


def build_mesh(dims: ParallelDims, device: torch.device) -> Meshes:
    """The named DeviceMesh over all dimensions (size-1 ones included, so code can always index them),
    plus the flattened views. Flattened meshes are kept here rather than re-sliced from the root."""
    from stalwart.runtime.group import device_mesh

    shape = tuple(dims.degrees()[n] for n in MESH_ORDER)
    if dims.ep > 1:
        # dp_shard = (dp_shard_mod_ep, ep), row-major, so a rank's dp_shard index is unchanged.
        names = MESH_ORDER[:2] + ("dp_shard_mod_ep", "ep") + MESH_ORDER[3:]
        shape = shape[:2] + (dims.dp_shard // dims.ep, dims.ep) + shape[3:]
        world = device_mesh(device, shape, names)
        world["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    else:
        world = device_mesh(device, shape, MESH_ORDER)
    dp = world["dp_replicate", "dp_shard"]._flatten("dp")
    if dims.cp > 1:
        shard = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        if dims.dp_replicate > 1:
            raise LayoutError("parallelism: HSDP (dp_replicate > 1) together with cp > 1 is not supported yet")
        fsdp = shard
    else:
        fsdp = world["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else world["dp_shard"]
    if dims.ep > 1:
        return Meshes(world=world, dp=dp, fsdp=fsdp, dims=dims, ep=world["ep"], expert_fsdp=world["dp_shard_mod_ep"])
    return Meshes(world=world, dp=dp, fsdp=fsdp, dims=dims)
