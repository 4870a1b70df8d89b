"""A generator's weight link, as the actors join it: a standalone group of the trainer ranks (group ranks
``0..T-1``) and one generator (group rank ``T``) on the controller's store, one key prefix per attempt
(``rl/weights.py`` decides when a link is joined; ``comm/weight_sync.py`` moves the tensors over it)."""

from __future__ import annotations


def link_prefix(generator: int, attempt: int) -> str:
    return f"weights/generator-{generator}/attempt-{attempt}"


def open_link(store_port: int, generator: int, attempt: int, rank: int, trainers: int, generators: int, device,
              setup_s: float, timeout_s: float):
    """Join ``generator``'s link as group rank ``rank``; tensors cross on the device when every trainer
    and generator has a GPU of its own (else through the host)."""
    from stalwart.comm.weight_sync import Link
    from stalwart.runtime.placement import exchange_device
    from stalwart.runtime.standalone import connect_store, standalone_group

    store = connect_store(store_port, setup_s)
    carrier = exchange_device(device, trainers + generators)
    group = standalone_group(store, link_prefix(generator, attempt), rank, trainers + 1, carrier, timeout_s, setup_s)
    return Link(group, trainers, rank, carrier)
