"""``python -m distcheck`` and ``torchrun ... -m distcheck``: see distcheck/cli.py."""
import sys

from distcheck.cli import main

if __name__ == "__main__":
    sys.exit(main())
