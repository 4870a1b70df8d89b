"""Topology-aware collectives over point-to-point messages.

Layers, bottom up: ``topology`` (hosts/racks/pods and tier costs, rank placement) -> ``team`` (ranks of
a group, p2p) -> ``algorithms`` / ``hierarchical`` (ring, recursive doubling, Rabenseifner, double
binary tree, two-level) -> ``collectives`` (public calls by algorithm name) -> ``cost`` (alpha-beta-
gamma prediction) -> ``selector`` (pick the fastest) -> ``grads`` (data-parallel gradient reduction,
DDP hook); ``netns`` builds emulated hosts. `stalwart bench collectives` (``stalwart.bench.collectives``)
measures them.
"""

from stalwart.comm.collectives import ALGORITHMS, all_gather, all_reduce, reduce_scatter
from stalwart.comm.grads import (
    reduce_gradients,
    register_selector_hook,
    selector_comm_hook,
)
from stalwart.comm.selector import CommConfig, Selector, build_selector
from stalwart.comm.topology import (
    Placement,
    Topology,
    detect_placement,
    flat_topology,
    load_topology,
)

__all__ = [
    "ALGORITHMS", "CommConfig", "Placement", "Selector", "Topology", "all_gather", "all_reduce",
    "build_selector", "detect_placement", "flat_topology", "load_topology", "reduce_gradients",
    "reduce_scatter", "register_selector_hook", "selector_comm_hook",
]
