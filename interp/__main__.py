"""``python -m interp train ...``: the training command, without the analyses package."""

import sys

from interp.train import main

sys.exit(main())
