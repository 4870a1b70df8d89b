"""`python -m stalwart ...` is the same as the `stalwart` console command."""

import sys

from stalwart.cli import main

if __name__ == "__main__":
    sys.exit(main())
