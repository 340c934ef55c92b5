"""``python -m tpu_ckpt``: the ``tpu-ckpt`` command line (see cli/_main.py)."""

import sys

from tpu_ckpt.cli import main

sys.exit(main())
