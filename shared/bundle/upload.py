"""``mcp-bundle push``'s transfer: stream a bundle to the control plane's ``/api/v1/bundles``.

Standard library HTTP (no aiohttp in ``shared/``), 1 MiB at a time, with an optional tqdm bar.
"""

from __future__ import annotations

import http.client
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mcp_edge.shared.errors import McpError


class UploadError(McpError):
    """The control plane could not be reached, or did not answer JSON."""


UPLOAD_CHUNK_BYTES = 1 << 20


def upload_bundle(
    server: str, token: str, bundle: Path, *, timeout: float, progress: bool
) -> tuple[int, Any]:
    """POST ``bundle`` to ``{server}/api/v1/bundles`` in chunks; return (status, JSON answer).

    Raises :class:`UploadError` when the server cannot be reached or does not answer JSON.
    """
    parts = urlsplit(server)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UploadError(f"--server {server!r} must be an http:// or https:// URL")
    conn_cls = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
    size = bundle.stat().st_size
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=size, desc="push", unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
        )
    try:
        try:
            conn.putrequest("POST", parts.path.rstrip("/") + "/api/v1/bundles")
            conn.putheader("Content-Type", "application/octet-stream")
            conn.putheader("Content-Length", str(size))
            conn.putheader("Authorization", f"Bearer {token}")
            conn.putheader("Accept", "application/json")
            conn.endheaders()
            with open(bundle, "rb") as f:
                while chunk := f.read(UPLOAD_CHUNK_BYTES):
                    conn.send(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
        except OSError as e:  # the server may answer (413, 401) before taking all the bytes
            sent_error: OSError | None = e
        else:
            sent_error = None
        try:
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as e:
            cause = sent_error or e
            raise UploadError(f"cannot push to {server}: {cause or type(cause).__name__}") from e
    finally:
        if bar is not None:
            bar.close()
        conn.close()
    try:
        return response.status, json.loads(raw) if raw else None
    except ValueError:
        raise UploadError(
            f"HTTP {response.status} from {server}, and the answer is not JSON "
            "(is it a control plane?)"
        ) from None
