"""``python -m aegis``: the same as the ``aegis`` command."""

import sys

from aegis.cli.main import main

sys.exit(main())
