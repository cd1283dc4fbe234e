"""`python -m roundpipe ...` is the `roundpipe` command."""
import sys

from roundpipe.commands.cli import main

sys.exit(main())
