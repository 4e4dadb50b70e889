"""Fixtures of the end-to-end tests beyond the shared ones: a real S3 API (moto's server)."""

from tests.s3 import moto_server, s3

__all__ = ["moto_server", "s3"]
