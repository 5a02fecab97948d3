"""The one error a setting raises: a value that is missing, unknown or invalid, named by its dotted key."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message names the key."""
