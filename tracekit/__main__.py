"""``python -m tracekit ...``: the same command line as the ``tracekit`` script (:func:`tracekit.cli.main`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
