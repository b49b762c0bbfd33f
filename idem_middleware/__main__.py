"""`python -m idem_middleware`: the `idem-middleware` command."""

import sys

from .cli import main

sys.exit(main())
