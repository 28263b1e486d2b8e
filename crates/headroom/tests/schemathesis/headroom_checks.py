"""Headroom's own schemathesis check, loaded by crates/headroom/tests/schemathesis.rs
(SCHEMATHESIS_HOOKS=headroom_checks): every error answer carries the API's JSON error body.

The document says so for the statuses it lists; this holds it for every 4xx and 5xx, listed
or not (a plain-text rejection from the framework would pass the other checks when its status
is undocumented and status_code_conformance is the only one to see it).
"""

import json

import schemathesis


@schemathesis.check
def error_has_json_body(ctx, response, case):
    """A 4xx or 5xx answer is `application/json` `{"error": str, "kind": str}`, both non-empty."""
    if response.status_code < 400 or case.method.upper() == "HEAD":
        return
    content_type = ",".join(response.headers.get("content-type", []))
    if not content_type.startswith("application/json"):
        raise AssertionError(
            f"{response.status_code} without a JSON body (content-type {content_type!r})"
        )
    try:
        body = json.loads(response.content)
    except ValueError as err:
        raise AssertionError(f"{response.status_code} with a body that is not JSON: {err}")
    if not isinstance(body, dict):
        raise AssertionError(f"{response.status_code} with a JSON body that is not an object")
    for field in ("error", "kind"):
        if not isinstance(body.get(field), str) or not body[field]:
            raise AssertionError(f"{response.status_code} whose error body has no {field!r}")
