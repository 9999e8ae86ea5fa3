"""``python -m device_check``: see :mod:`device_check.check`."""

import sys

from device_check.check import main

sys.exit(main())
