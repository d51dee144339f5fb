"""Subcommands of the gptlab CLI, one module each (see gptlab.cli)."""
