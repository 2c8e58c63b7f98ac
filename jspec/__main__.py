"""``python -m jspec``: the ``jspec`` command run by this interpreter. Where pip installs its
scripts for another Python than the one on PATH (a GPU image with JAX in a venv beside the system
Python), ``python3 -m jspec`` still runs with the interpreter that has JAX."""

import sys

from jspec.cli import main

sys.exit(main())
