"""ivy-sandbox: a self-hostable implementation of the Ivy sandbox API."""

__version__ = "0.1.0"
