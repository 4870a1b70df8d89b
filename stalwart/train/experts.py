"""Mixture-of-experts bookkeeping after each optimizer step: routing statistics and bias balancing.

Every sparse layer counts, during the step's forward passes, how many tokens chose each expert, the
router entropy and its auxiliary loss. Here they are summed over all ranks (data-parallel ranks see
different tokens; tensor-parallel ranks route the same tokens, so their sum is divided by ``tp``;
pipeline stages own different layers), turned into the step record's ``moe_*`` fields, and used for
auxiliary-loss-free balancing (DeepSeek-V3): each expert's routing bias moves by ``bias_update_rate``
towards balance, ``bias += rate * sign(mean load - load)``. The counts are global, so every rank applies
the same update and the biases stay identical everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from stalwart.models.flavors import TransformerArgs
from stalwart.models.moe import MoE, moe_modules
from stalwart.parallel.dims import ParallelDims


def imbalance(counts: torch.Tensor) -> float:
    """max / mean of a load vector (1.0 = perfectly balanced); 0 when nothing was routed."""
    mean = float(counts.float().mean())
    return float(counts.max()) / mean if mean > 0 else 0.0


@torch.no_grad()
def update_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """Move the routing bias of over-loaded experts down and of under-loaded ones up by ``rate``."""
    bias += rate * torch.sign(counts.float().mean() - counts.float()).to(bias.dtype)


class ExpertBalancer:
    """Collects the sparse layers' statistics after a step, balances, and reports (collective)."""

    def __init__(self, stages: list[nn.Module], args: TransformerArgs, dims: ParallelDims, device: torch.device,
                 distributed: bool, expert_comm=None) -> None:
        self.args, self.dims, self.device, self.distributed = args, dims, device, distributed
        self.layers: dict[int, MoE] = {}
        for stage in stages:
            self.layers.update(moe_modules(stage))
        self.comm = expert_comm

    @staticmethod
    def wanted(args: TransformerArgs) -> bool:
        return args.moe is not None

    @torch.no_grad()
    def after_step(self, committed: bool) -> dict:
        """The step's ``moe_*`` record fields; the bias update when the step's update was applied."""
        m = self.args.moe
        n_exp = m.n_experts
        n_misc = len(MoE.STAT_MISC)
        # Per layer: tokens per expert, the misc sums, the routing bias this step used.
        stats = torch.zeros(self.args.n_layers, 2 * n_exp + n_misc, dtype=torch.float64, device=self.device)
        for i, layer in self.layers.items():
            stats[i, :n_exp] = layer.stat_tokens
            stats[i, n_exp:n_exp + n_misc] = layer.stat_misc
            stats[i, n_exp + n_misc:] = layer.router.expert_bias.double()
            layer.reset_stats()
        comm_s = torch.tensor([self.comm.seconds if self.comm else 0.0], dtype=torch.float64, device=self.device)
        if self.distributed:
            dist.all_reduce(stats)
            dist.all_reduce(comm_s, op=dist.ReduceOp.MAX)
        if self.comm is not None:
            self.comm.reset()
        sparse = [i for i in range(self.args.n_layers) if self.args.is_moe_layer(i)]
        counts = stats[sparse, :n_exp] / self.dims.tp  # (sparse layers, experts)
        aux_sum, entropy_sum, tokens, forwards = (stats[sparse, n_exp + j] for j in range(4))
        if committed and m.bias_update_rate > 0:
            for row, i in enumerate(sparse):
                if i in self.layers:
                    update_bias(self.layers[i].router.expert_bias, counts[row], m.bias_update_rate)
        per_layer = [imbalance(c) for c in counts]
        record = {
            "moe_load_imbalance": sum(per_layer) / len(per_layer),       # mean over layers of max/mean
            "moe_load_imbalance_max": max(per_layer),
            "moe_router_entropy": float((entropy_sum / tokens.clamp_min(1)).mean()),
            "moe_tokens_per_expert": {str(i): [int(round(float(x))) for x in c] for i, c in zip(sparse, counts)},
            # Every rank of a layer's pipeline stage holds the same bias: the sum over ranks / their number.
            "moe_expert_bias": {str(i): [round(float(b), 6) for b in stats[i, n_exp + n_misc:] * self.dims.pp
                                         / self.dims.world_size] for i in sparse},
        }
        if m.aux_loss_coef > 0:
            record["moe_aux_loss"] = float((aux_sum / forwards.clamp_min(1)).sum())
        if self.dims.ep > 1:
            per_rank = counts.view(len(sparse), self.dims.ep, -1).sum(-1)  # tokens each ep rank's experts took
            record["moe_ep_imbalance"] = max(imbalance(r) for r in per_rank)
            record["moe_a2a_s"] = float(comm_s[0])
        return record
