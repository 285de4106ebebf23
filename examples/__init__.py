"""Runnable examples: ``python -m examples.<name> [--help]`` from the repository root."""
