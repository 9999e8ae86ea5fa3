"""``python -m demo``: see :mod:`demo.cli`."""

import sys

from demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
