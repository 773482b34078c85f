"""`python -m daemon ...` is the `deepinfer` command."""

import sys

from daemon.service.cli import main

sys.exit(main())
