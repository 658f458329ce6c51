"""``python3 -m mha_ep.bench WHAT [options]``: the same as ``mha-ep bench``."""

import sys

from mha_ep.bench import main

sys.exit(main())
