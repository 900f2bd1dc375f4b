"""`python -m elastic_ddp.chaos --help`: see elastic_ddp/chaos/cli.py."""

import sys

from elastic_ddp.chaos.cli import main

sys.exit(main())
