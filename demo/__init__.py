"""The live capture demo (``python -m demo``, ``make demo``); not part of the installed library."""
