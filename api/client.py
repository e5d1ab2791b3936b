"""A small Python client for the cpn REST API; the `cpn` CLI uses it too."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class ApiError(Exception):
    """A problem answer from the API (RFC 9457), or a transport failure (status 0)."""

    def __init__(self, status: int, title: str, detail: str, errors: list[Any] | None = None):
        super().__init__(f"{status} {title}: {detail}" if status else detail)
        self.status, self.title, self.detail, self.errors = status, title, detail, errors or []


class Client:
    """Talks to one cpn control plane with one bearer key."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = (url or os.environ.get("CPN_URL") or DEFAULT_URL).rstrip("/")
        token = token or os.environ.get("CPN_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(0, "unreachable", f"cannot reach {self.url}: {exc}") from exc
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {}
            raise ApiError(
                response.status_code,
                str(body.get("title", response.reason_phrase)),
                str(body.get("detail", response.text[:200])),
                body.get("errors"),
            )
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body)

    def paginate(self, path: str, page_size: int = 500, **params: Any) -> Iterator[Any]:
        """Every item of a paginated list, fetching page after page."""
        offset = 0
        while True:
            page = self.get(path, limit=page_size, offset=offset, **params)
            yield from page["items"]
            offset += len(page["items"])
            if not page["items"] or offset >= page["total"]:
                return

    # Admin helpers used by the CLI and the demo.
    def create_cluster(self, name: str, region: str, **labels: str) -> Any:
        return self.post("/v1/clusters", {"name": name, "region": region, "labels": labels})

    def declare_link(self, src: str, dst: str, **values: Any) -> Any:
        return self.post("/v1/links", {"src": src, "dst": dst, **values})

    def create_api_key(self, role: str, scope: str | None = None, name: str = "") -> Any:
        return self.post("/v1/api-keys", {"role": role, "scope": scope, "name": name})

    def clusters(self) -> list[Any]:
        return list(self.paginate("/v1/clusters"))

    def links(self, view: str = "effective") -> list[Any]:
        return list(self.paginate("/v1/links", view=view))

    def gpus(self) -> list[Any]:
        return list(self.paginate("/v1/gpus"))
