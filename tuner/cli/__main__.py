"""``python -m colltune.cli``: the same as the ``colltune`` command."""

import sys

from colltune.cli import main

sys.exit(main())
