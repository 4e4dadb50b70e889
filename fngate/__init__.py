"""fngate: ML models served as serverless functions behind one shared Redis queue."""

from importlib import metadata

try:
    __version__ = metadata.version("fngate")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
