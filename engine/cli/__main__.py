"""``python -m ditserve.engine.cli``: the ``ditserve`` command."""

import sys

from ditserve.engine.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
