"""``python -m deepinfer.cli``: what the ``deepinfer`` console script runs, for a checkout without it installed."""

from deepinfer.cli import main

main()
