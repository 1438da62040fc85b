"""``python cli.py COMMAND ...``: an alias of the installed ``lragent`` console command (lragent/cli_main.py)."""

import sys

from lragent.cli_main import main

if __name__ == "__main__":
    sys.exit(main())
