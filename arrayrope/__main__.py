"""``python -m arrayrope warmup``: compile the common kernels into the disk cache."""

import sys

from ._warmup import main

sys.exit(main())
