"""`torchrun ... -m stalwart.train [--config X] [--section.key V ...]`: one worker per process."""

import sys

from stalwart.train.worker import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
