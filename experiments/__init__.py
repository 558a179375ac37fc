"""Benchmarks and evaluations: the ``policyd bench*``, ``eval-*``, ``throughput`` and ``matrix``
subcommands' code. They import ``policyd``; nothing in ``policyd/``, ``connector/`` or ``ui/``
imports them (``policyd/cli/__init__.py`` names their modules as strings, imported when a command
runs; tests/test_layers.py).
"""
