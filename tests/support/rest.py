"""Blocking REST calls as an admin against a control plane served in another process (the
end-to-end fleets of tests/integration and tests/ui)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

Json = dict[str, Any]


class AdminRest:
    """Mixed into a fleet dataclass that has ``url`` (the control plane) and ``token``."""

    url: str
    token: str

    def call(self, method: str, path: str, body: Json | None = None) -> tuple[int, Any]:
        """One REST call as the admin; (status, decoded JSON answer) whatever the status."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.token}"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=15) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def get(self, path: str) -> Any:
        status, answer = self.call("GET", path)
        assert status == 200, f"GET {path}: {status} {answer}"
        return answer

    def post(self, path: str, body: Json, expect: int = 200) -> Any:
        status, answer = self.call("POST", path, body)
        assert status == expect, f"POST {path}: {status} {answer}"
        return answer
