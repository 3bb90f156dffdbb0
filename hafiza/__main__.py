"""`python -m hafiza` runs the CLI."""

from hafiza.cli import main

main()
