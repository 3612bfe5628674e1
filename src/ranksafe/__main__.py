"""``python -m ranksafe ...`` (``torchrun -m ranksafe doctor ROOT``): the same as the ``ranksafe`` command."""

import sys

from .cli import main

sys.exit(main())
