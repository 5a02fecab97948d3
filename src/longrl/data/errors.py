"""The error every data check raises."""


class DataError(ValueError):
    """The dataset cannot be used; the message names the file, column or row."""
