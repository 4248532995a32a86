"""``python -m redirect.cli``: the ``redirect`` command."""

import sys

from .main import main

sys.exit(main())
