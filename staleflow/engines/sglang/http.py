"""A small JSON-over-HTTP client for one SGLang server (standard library only).

Every call has a timeout, and a refused connection or an error status raises
:class:`SGLangError` naming the server, the route and SGLang's message, so a server that
died surfaces as an error instead of a hang.
"""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit


class SGLangError(RuntimeError):
    """A call to an SGLang server failed; the message names the server and the route."""


class SGLangHTTP:
    def __init__(self, base_url: str, *, timeout_s: float = 60.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"base_url={base_url!r}: use http://HOST:PORT")
        self.base_url = base_url.rstrip("/")
        self._host, self._port = parts.hostname, parts.port
        self.timeout_s = timeout_s

    def get(self, path: str, *, timeout_s: float | None = None) -> Any:
        return self._call("GET", path, None, timeout_s)

    def post(
        self, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> Any:
        return self._call("POST", path, body or {}, timeout_s)

    def status(self, path: str, *, timeout_s: float = 5.0) -> int:
        """The status code of ``GET path`` (0 when the server cannot be reached)."""
        conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            return conn.getresponse().status
        except OSError:
            return 0
        finally:
            conn.close()

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float | None
    ) -> Any:
        conn = http.client.HTTPConnection(
            self._host, self._port, timeout=self.timeout_s if timeout_s is None else timeout_s
        )
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except OSError as exc:
            raise SGLangError(
                f"SGLang server {self.base_url}: {method} {path} failed: {exc}"
            ) from exc
        finally:
            conn.close()
        text = data.decode("utf-8", "replace")
        try:
            parsed: Any = json.loads(text) if text.strip() else None
        except ValueError:
            parsed = text
        if response.status >= 400:
            message = parsed.get("message", parsed) if isinstance(parsed, dict) else parsed
            raise SGLangError(
                f"SGLang server {self.base_url}: {method} {path} answered {response.status}: "
                f"{message}"
            )
        return parsed
