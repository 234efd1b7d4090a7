"""The one base of every error that is the user's to fix (bad config, missing input, a budget
nothing fits in...). Each package derives its own from it; the CLI catches the base, prints one
line and exits 2. Anything else is a bug and keeps its traceback."""


class HetforgeError(Exception):
    """A problem phrased for the user: what is wrong, where, and what to do."""


class ConfigError(HetforgeError, ValueError):
    """A configuration problem (field name + allowed values)."""
