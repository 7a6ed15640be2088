"""`python -m hybridjit`: the `hybridjit` command."""

import sys

from hybridjit.cli import main

sys.exit(main())
