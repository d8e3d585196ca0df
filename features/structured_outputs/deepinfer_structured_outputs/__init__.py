"""Structured outputs: so_args constraints matched by xgrammar."""
