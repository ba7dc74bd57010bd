import pytest

from meshserve.models.loader import resolve_model
from tests.gateway.fleet import Fleet


@pytest.fixture(scope="package")
def fleet():
    """Two replicas shared by every gateway test (each test starts its own gateways)."""
    resolve_model("default")  # the one-time conversion, before two processes want it at once
    f = Fleet(2)
    try:
        f.start()
        yield f
    finally:
        f.stop()
