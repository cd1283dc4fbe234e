"""`python -m roundpipe ...` is the `roundpipe` command."""
import sys

from roundpipe.cli import main

sys.exit(main())
