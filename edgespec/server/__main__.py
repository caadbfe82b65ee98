"""`python -m edgespec.server`: the serve verb on its own (the CLI registers it as `serve`)."""
import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
