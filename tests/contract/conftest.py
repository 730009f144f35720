"""Fixtures for the backend contract suite: the real storage servers it runs against."""

from tests.servers import azurite_server, moto_server  # noqa: F401
