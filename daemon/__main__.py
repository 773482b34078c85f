"""`python -m daemon ...` is the `deepinfer` command."""

import sys

from daemon.cli import main

sys.exit(main())
