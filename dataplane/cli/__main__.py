"""``python -m dataplane.cli``: the ``dataplane`` console script."""

import sys

from dataplane.cli import main

sys.exit(main())
