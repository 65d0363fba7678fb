"""``python -m checkpoint``: the ``fqnckpt`` command line."""

import sys

from .cli import main

sys.exit(main())
