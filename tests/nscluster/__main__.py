"""``python -m tests.nscluster up|down|status`` (see ``cli``)."""

import sys

from .cli import main

sys.exit(main())
