"""`python -m skylb` runs the `skylb` command."""

import sys

from skylb.cli import main

sys.exit(main())
