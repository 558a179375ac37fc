"""``python -m policyd.cli``: the ``policyd`` command without its console script."""

import sys

from policyd.cli import main

sys.exit(main())
