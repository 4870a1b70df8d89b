"""A generator's weight link, as the actors join it: a standalone group of the trainer ranks (group ranks
``0..T-1``) and the generator's processes (group ranks ``T..T+P-1``, one per tensor-parallel rank of its
engine) on the controller's store, one key prefix per attempt (``rl/weights.py`` decides when a link is
joined; ``comm/weight_sync.py`` moves the tensors over it). Once formed, each generator process tells the
trainers what it takes (its shards, or the full tensors)."""

from __future__ import annotations


def link_prefix(generator: int, attempt: int) -> str:
    return f"weights/generator-{generator}/attempt-{attempt}"


def open_link(store_port: int, generator: int, attempt: int, rank: int, trainers: int, generators: int, device,
              setup_s: float, timeout_s: float, receivers: int = 1, want=None):
    """Join ``generator``'s link as group rank ``rank`` (a trainer's rank, or ``trainers`` plus the
    generator process's tensor-parallel rank, which passes its ``comm.weight_sync.Want``); ``receivers``
    processes make up each of the ``generators`` generators. Tensors cross on the device when every
    trainer and generator process has a GPU of its own (else through the host)."""
    from stalwart.comm.weight_sync import Link, exchange_wants
    from stalwart.runtime.placement import exchange_device
    from stalwart.runtime.standalone import connect_store, standalone_group

    store = connect_store(store_port, setup_s)
    carrier = exchange_device(device, trainers + generators * receivers)
    group = standalone_group(store, link_prefix(generator, attempt), rank, trainers + receivers, carrier, timeout_s,
                             setup_s)
    link = Link(group, trainers, rank, carrier)
    exchange_wants(link, want, receivers)
    return link
