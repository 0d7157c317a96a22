"""The package version, which every rank of a job must share."""

__version__ = "0.1.0"
