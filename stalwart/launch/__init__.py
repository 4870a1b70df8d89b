"""Starting training processes: the supervised local launcher (``stalwart train --nproc-per-node N``)
and torch's elastic agent with Stalwart's supervisor (``agent``), also the multi-node entry point.

The launcher runs the workers as ``-m stalwart.train`` subprocesses; it never imports the trainer.
"""
