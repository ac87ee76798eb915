"""`python -m sharpi_cli`: the console script, for an environment whose scripts directory is not on PATH."""
from .entry import main

main()
