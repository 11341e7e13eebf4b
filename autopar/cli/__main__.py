"""``python -m autopar.cli``: the ``autopar`` command."""

import sys

from autopar.cli import main

sys.exit(main())
