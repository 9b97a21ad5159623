"""``python -m arrayrope``: see ``python -m arrayrope --help``."""

import sys

from ._cli import main

sys.exit(main())
