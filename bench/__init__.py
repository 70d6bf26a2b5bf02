"""The benchmark harness: `python -m bench <command>` (bench/__main__.py lists the commands)."""
