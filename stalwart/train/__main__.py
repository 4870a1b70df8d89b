"""`torchrun ... -m stalwart.train [--config X] [--section.key V ...]`: one worker per process."""

import sys

from stalwart.config.loading import parse_train_argv
from stalwart.errors import UserError
from stalwart.train.worker import worker_main


def main(argv: list[str]) -> int:
    try:
        _, cfg = parse_train_argv(argv)
    except UserError as e:
        print(f"stalwart train: error: {e}", file=sys.stderr, flush=True)
        return 2
    return worker_main(cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
