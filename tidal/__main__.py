"""`python -m tidal ...`: the same as `python launch.py ...` and the installed `tidal` command."""
import sys

from tidal.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
