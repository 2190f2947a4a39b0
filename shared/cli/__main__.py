"""`python -m shared.cli` is `actq`."""

from shared.cli import main

main()
