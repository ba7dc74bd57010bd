"""How a refused or failed lease/hand-off call answers over HTTP (both routes share it)."""
import pytest

from meshserve.engine.errors import EngineCallError, EngineDeadError
from meshserve.server.call_errors import lease_call_error


@pytest.mark.parametrize("exc,status,code,retry", [
    (EngineDeadError("the engine process exited"), 503, "engine_unavailable", "5"),
    (EngineCallError("no leases here", unsupported=True), 501, "kv_role_unsupported", None),
    (EngineCallError("lease 'x' does not exist", not_found=True), 404, "reservation_not_found", None),
    (EngineCallError("4 leases held", limit=True), 429, "too_many_reservations", "1"),
    (EngineCallError("max_tokens must be at least 1"), 400, "invalid_parameter", None),
])
def test_each_refusal_has_its_status_and_code(exc, status, code, retry):
    err = lease_call_error(exc, "kv_role_unsupported")
    assert (err.status, err.code) == (status, code)
    assert err.headers.get("Retry-After") == retry
    assert str(exc) in err.message
