"""Single-controller training: one Python process drives actor meshes of trainers (Monarch).

``mesh`` (spawn, call, wait, replace), ``actor`` (the trainer actor over its own gloo group),
``feed`` (the data, cut per actor), ``journal`` (the durable command history), ``recovery`` (pure
decisions), ``driver`` (``stalwart train --controller``). See docs/controller.md.
"""
