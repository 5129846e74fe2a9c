"""``python -m graphsafe``: the same command line as the ``graphsafe`` console script."""

from graphsafe.cli import main

raise SystemExit(main())
