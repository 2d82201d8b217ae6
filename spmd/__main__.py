"""``python -m spmd``: the ``spmd`` command (``spmd demo``, ``spmd bench``, ``spmd inspect``, ``spmd timeline``)."""

import sys

from spmd.tools.cli import main

sys.exit(main())
