"""`python -m tilefuse`: the `tilefuse` command (slower to start than the console script, as
the package, and torch, are imported first)."""
import sys

from tilefuse_cli import main

sys.exit(main())
