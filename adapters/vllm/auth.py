"""The vLLM server's API key: every route but a few public ones guarded, and clients that send it.

vLLM's ``--api-key`` (or ``VLLM_API_KEY``) guards only the routes under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` (``vllm/entrypoints/serve/middleware/authenticate.py``); the
dev-mode routes a trainer needs (``/pause``, ``/resume``, ``/collective_rpc``,
``/reset_prefix_cache``, ``/server_info``, the weight-transfer routes) and others that run the
model (``/invocations``, ``/tokenize``, ``/pooling``...) answer whoever reaches the port.
Here, with a key configured, every route needs it except :data:`PUBLIC_PATHS` (probes and
metrics):

- asyncgrpo's vLLM plugin (:mod:`asyncgrpo.adapters.transfer.plugin`) makes vLLM's own key
  middleware guard every route (:func:`guard_every_route`), with the keys vLLM was given;
- ``--middleware asyncgrpo.adapters.vllm.auth.DevRoutesAuth`` does the same without the plugin,
  with the key in ``VLLM_API_KEY`` (servers asyncgrpo starts get a random one per run).

The trainer's side: :func:`bearer` is the ``Authorization: Bearer <key>`` header its clients
send (``VLLMClient(headers=...)``, made in one place: ``asyncgrpo.shell.servers.ServerSettings``;
the weight-transfer client of :mod:`asyncgrpo.adapters.transfer.engine`).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
from collections.abc import Sequence
from typing import Any

from asyncgrpo.adapters.vllm.patch_targets import patch_target

PUBLIC_PATHS = ("/health", "/ping", "/version", "/metrics", "/load")
"""Routes that stay open: liveness and readiness probes, the version, Prometheus metrics."""
PATCHED = "_asyncgrpo_guards_every_route"
API_KEY_ENV = "VLLM_API_KEY"


def new_api_key() -> str:
    """A random key for a server started for one run (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def bearer(api_key: str | None) -> dict[str, str]:
    """The request headers that carry ``api_key`` (none without a key).

    Example:
        >>> bearer("k"), bearer(None)
        ({'Authorization': 'Bearer k'}, {})
    """
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def is_public(path: str) -> bool:
    """Whether ``path`` stays open without the key.

    Example:
        >>> [is_public(p) for p in ("/health", "/metrics/", "/pause", "/v1/models")]
        [True, True, False, False]
    """
    return (path.rstrip("/") or "/") in PUBLIC_PATHS


def _hashes(tokens: Sequence[str]) -> list[bytes]:
    return [hashlib.sha256(t.encode("utf-8")).digest() for t in tokens if t]


def _verified(authorization: str | None, hashes: Sequence[bytes]) -> bool:
    """Whether an ``Authorization`` header holds one of the keys (compared in constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    digest = hashlib.sha256(token.encode("utf-8")).digest()
    matched = False
    for expected in hashes:
        matched |= secrets.compare_digest(digest, expected)
    return matched


def _needs_key(scope: dict[str, Any]) -> bool:
    if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
        return False
    path = scope["path"].removeprefix(scope.get("root_path", ""))
    return not is_public(path)


def _refuse(scope: dict[str, Any], receive: Any, send: Any) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)


def _authorization(scope: dict[str, Any]) -> str | None:
    from starlette.datastructures import Headers

    return Headers(scope=scope).get("Authorization")


def configured_keys(argv: Sequence[str] | None = None) -> list[str]:
    """The server's keys: ``--api-key`` on its command line (vLLM's precedence), else
    ``VLLM_API_KEY``."""
    argv = list(sys.argv if argv is None else argv)
    keys: list[str] = []
    for index, arg in enumerate(argv):
        if arg == "--api-key":
            keys += [a for a in argv[index + 1 :] if not a.startswith("-")][:1]
        elif arg.startswith("--api-key="):
            keys.append(arg.split("=", 1)[1])
    if keys:
        return keys
    from_env = os.environ.get(API_KEY_ENV, "")
    return [from_env] if from_env else []


class DevRoutesAuth:
    """ASGI middleware for ``vllm serve --middleware asyncgrpo.adapters.vllm.auth.DevRoutesAuth``:
    every route but :data:`PUBLIC_PATHS` answers 401 without ``Authorization: Bearer <key>``.

    The key is the server's ``--api-key`` or ``VLLM_API_KEY`` (set the variable: a key on the
    command line is visible to every user of the machine). Without one the server refuses to
    start serving, rather than serve unguarded.
    """

    def __init__(self, app: Any, tokens: Sequence[str] | None = None) -> None:
        keys = list(tokens) if tokens is not None else configured_keys()
        if not keys:
            raise RuntimeError(
                "asyncgrpo.adapters.vllm.auth.DevRoutesAuth needs an API key: set VLLM_API_KEY "
                "in the server's environment (or pass --api-key)"
            )
        self.app = app
        self._hashes = _hashes(keys)

    def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
        if _needs_key(scope) and not _verified(_authorization(scope), self._hashes):
            return _refuse(scope, receive, send)
        return self.app(scope, receive, send)


def guard_every_route(argv: Sequence[str] | None = None) -> None:
    """On a server given an API key (``--api-key`` in ``argv``, default :data:`sys.argv`, or
    ``VLLM_API_KEY``: :func:`configured_keys`), make vLLM's key middleware guard every route
    but :data:`PUBLIC_PATHS`, not only ``/v1`` and the like. vLLM imports that class when it
    builds the app, after its plugins are loaded, so the subclass put in its place is the one
    used. Idempotent; a process without a key (a server not asked for one, or a process that
    only imports vLLM) is left as it is.

    Raises:
        VLLMPatchTargetMissing: the server has a key and vLLM has no such middleware.
    """
    if not configured_keys(argv):
        return
    module = "vllm.entrypoints.serve.middleware.authenticate"
    original = patch_target(module, "AuthenticationMiddleware")
    if getattr(original, PATCHED, False):
        return
    authenticate = sys.modules[module]  # imported by patch_target

    class EveryRouteAuthentication(original):  # type: ignore[misc, valid-type]
        """vLLM's ``AuthenticationMiddleware`` over every route but the public ones."""

        def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
            if _needs_key(scope) and not _verified(_authorization(scope), self.api_tokens):
                return _refuse(scope, receive, send)
            return self.app(scope, receive, send)

    setattr(EveryRouteAuthentication, PATCHED, True)
    # into the module's namespace (a ModuleType declares none of its names to the type checker)
    vars(authenticate)["AuthenticationMiddleware"] = EveryRouteAuthentication
