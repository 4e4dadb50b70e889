"""fngate: ML models served as serverless functions behind one shared Redis queue."""

__version__ = "0.1.0"
