"""`python -m ditserve.operator`: the same as the `ditserve-operator` command."""

from ditserve.operator.main import main

raise SystemExit(main())
