"""One OpenAI-compatible server: its address, credentials, discovery and error messages.

`--engine URL` takes the server's root or its `/v1`; chat goes to ROOT/v1 (the
`openai` client: SSE parsing, retries with backoff, timeouts), and what the
OpenAI API has no word for goes to the engine's own endpoints on ROOT
(`/metrics`, `/props`, `/tokenize`, `/slots`) through the HTTP library the
`openai` client is built on (httpx2, or httpx before it), with the same key and certificate
checks. The API key comes from an environment variable and is kept only in
memory: never logged, stored or put into an error message.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import openai

try:  # the HTTP library the installed `openai` client is built on
    import httpx2
except ImportError:  # older `openai` releases use httpx, the same API
    import httpx as httpx2  # type: ignore[no-redef]

from kvchat.errors import KvchatError
from kvchat.remote.metrics import detect_kind

DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"
DEFAULT_SESSION_HEADER = "X-Session-ID"
STALL_TIMEOUT_S = 60.0  # no byte from the server for this long: the stream has stalled
NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llama-server": "llama-server", "unknown": "server"}
# the flag that makes each engine report usage.prompt_tokens_details.cached_tokens
CACHE_REPORT_FLAGS = {
    "vllm": "--enable-prefix-caching --enable-prompt-tokens-details",
    "sglang": "--enable-cache-report",
    "llama-server": "(it always reports them)",
    "unknown": "its option that reports usage.prompt_tokens_details",
}


class RemoteError(KvchatError):
    """A server or connection failure, as one line saying what to do."""


@dataclass(frozen=True)
class RemoteOptions:
    url: str
    model: str | None = None
    api_key_env: str = DEFAULT_API_KEY_ENV
    session_header: str = DEFAULT_SESSION_HEADER
    stall_timeout_s: float = STALL_TIMEOUT_S


def server_root(url: str) -> str:
    """The server's root from `--engine URL` (a trailing `/v1` stripped); RemoteError if bad."""
    text = url.strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RemoteError(
            f"--engine takes 'embedded' or a server's http(s) URL such as "
            f"http://127.0.0.1:8000/v1, not {url!r}"
        )
    if text.endswith("/v1"):
        text = text[: -len("/v1")]
    return text


@dataclass(frozen=True)
class ServerInfo:
    """What `RemoteServer.discover` found out at connect time."""

    kind: str  # "vllm" | "sglang" | "llama-server" | "unknown"
    model: str
    models: tuple[str, ...]
    context_length: int | None
    has_metrics: bool
    reports_cached: bool | None = None  # None until probed

    @property
    def name(self) -> str:
        return NAMES.get(self.kind, self.kind)


class RemoteServer:
    """Clients for one server; safe to share across threads."""

    def __init__(self, options: RemoteOptions) -> None:
        self.options = options
        self.root = server_root(options.url)
        self.api_key_env = options.api_key_env
        self._key = os.environ.get(options.api_key_env) or None
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        self.http = httpx2.Client(
            base_url=self.root, headers=headers, timeout=httpx2.Timeout(10.0), verify=True
        )
        self.client = openai.OpenAI(
            base_url=self.root + "/v1",
            # the client insists on a key; servers started without --api-key ignore it
            api_key=self._key or "none",
            max_retries=2,  # with backoff, before any byte of a reply (connect, 429, 5xx)
            timeout=httpx2.Timeout(options.stall_timeout_s, connect=10.0),
        )

    # ------------------------------------------------------------- plain HTTP

    def get(self, path: str) -> httpx2.Response:
        return self.http.get(path)

    def get_json(self, path: str) -> Any | None:
        """The JSON of a GET, or None when the endpoint is missing or not JSON."""
        try:
            response = self.http.get(path)
        except httpx2.HTTPError:
            return None
        if response.status_code != 200:
            return None
        with contextlib.suppress(ValueError):
            return response.json()
        return None

    def post_json(self, path: str, body: dict[str, Any]) -> Any | None:
        try:
            response = self.http.post(path, json=body)
        except httpx2.HTTPError:
            return None
        if response.status_code != 200:
            return None
        with contextlib.suppress(ValueError):
            return response.json()
        return None

    def metrics_text(self) -> str:
        response = self.http.get("/metrics")
        response.raise_for_status()
        return response.text

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.http.close()
        with contextlib.suppress(Exception):
            self.client.close()

    # -------------------------------------------------------------- discovery

    def discover(self, model: str | None = None) -> ServerInfo:
        """Models, engine kind and context length; RemoteError when the server cannot serve."""
        try:
            page = self.client.models.list()
            listed = list(page.data)
        except Exception as exc:
            raise RemoteError(self.explain(exc, model=model)) from None
        names = tuple(m.id for m in listed)
        if not names:
            raise RemoteError(f"the server at {self.root} serves no model")
        chosen = model or names[0]
        if chosen not in names:
            raise RemoteError(
                f"the server at {self.root} has no model {chosen!r}; it serves "
                f"{', '.join(names)} (pick one with --remote-model)"
            )
        entry = listed[names.index(chosen)]
        extra = dict(entry.model_extra or {})
        metrics_text = ""
        with contextlib.suppress(httpx2.HTTPError):
            response = self.http.get("/metrics")
            if response.status_code == 200:
                metrics_text = response.text
        kind = detect_kind(metrics_text) if metrics_text else "unknown"
        props = None
        if kind == "unknown":
            owner = str(getattr(entry, "owned_by", "") or "").lower()
            owners = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llama-server"}
            for word, found in owners.items():
                if word in owner:
                    kind = found
        if kind in ("unknown", "llama-server"):
            props = self.get_json("/props")
            llama_props = isinstance(props, dict) and "default_generation_settings" in props
            if kind == "unknown" and llama_props:
                kind = "llama-server"
        context = _int(extra.get("max_model_len"))
        if context is None and isinstance(props, dict):
            settings = props.get("default_generation_settings") or {}
            context = _int(settings.get("n_ctx")) or _int(props.get("n_ctx"))
        if context is None and kind == "sglang":
            info = self.get_json("/get_model_info") or {}
            context = _int(info.get("max_context_length")) if isinstance(info, dict) else None
        return ServerInfo(kind, chosen, names, context, bool(metrics_text))

    def probe_cached_tokens(self, info: ServerInfo) -> bool:
        """Whether the server reports cached prompt tokens (one prompt of ~400 tokens twice)."""
        if info.kind == "llama-server":
            return True
        # long enough for whole cache blocks (vLLM counts hits in blocks of 16-128 tokens)
        text = " ".join(f"kvchat cache probe line {i}." for i in range(60))
        seen = False
        for _ in range(2):
            try:
                reply = self.client.chat.completions.create(
                    model=info.model,
                    messages=[{"role": "user", "content": text}],
                    max_tokens=1,
                    temperature=0.0,
                )
            except Exception:
                return False
            details = getattr(reply.usage, "prompt_tokens_details", None) if reply.usage else None
            cached = getattr(details, "cached_tokens", None) if details is not None else None
            if isinstance(cached, int):
                seen = True
        return seen

    # ------------------------------------------------------------------ errors

    def explain(
        self, exc: BaseException, *, model: str | None = None, context: int | None = None
    ) -> str:
        """One line for a user: what went wrong with the server and what to do."""
        root = self.root
        if isinstance(exc, openai.APITimeoutError | httpx2.TimeoutException):
            return (
                f"the server at {root} stopped answering (no data for "
                f"{self.options.stall_timeout_s:.0f} s); check that it is running and not "
                "overloaded"
            )
        if isinstance(exc, openai.APIConnectionError | httpx2.TransportError):
            return f"cannot reach the server at {root}: is it running? Check --engine URL"
        if isinstance(exc, openai.AuthenticationError):
            if self._key is None:
                return (
                    f"the server at {root} wants an API key (401): set the environment "
                    f"variable {self.api_key_env} (or name another with --api-key-env)"
                )
            return (
                f"the server at {root} refused the API key in {self.api_key_env} (401); "
                "set it to the key the server was started with"
            )
        if isinstance(exc, openai.PermissionDeniedError):
            return (
                f"the server at {root} refused access (403) with the key in "
                f"{self.api_key_env}; check the key's permissions"
            )
        if isinstance(exc, openai.NotFoundError):
            return (
                f"the server at {root} has no model {model!r} (404); "
                "pick one of `/v1/models` with --remote-model"
            )
        if isinstance(exc, openai.RateLimitError):
            return f"the server at {root} is busy (429 Too Many Requests); try again in a moment"
        if isinstance(exc, openai.BadRequestError):
            detail = self._scrub(_message(exc))
            if _is_overflow(detail):
                limit = f" of {context} tokens" if context else ""
                return (
                    f"the conversation does not fit in the server's context{limit} (400): "
                    "start a new session or lower max_tokens"
                )
            return f"the server at {root} refused the request (400): {detail}"
        if isinstance(exc, openai.APIStatusError):
            return (
                f"the server at {root} failed (HTTP {exc.status_code}): "
                f"{self._scrub(_message(exc))}; try again, or see its log"
            )
        return f"the server at {root} failed: {self._scrub(str(exc) or type(exc).__name__)}"

    def _scrub(self, text: str) -> str:
        if self._key:
            text = text.replace(self._key, "***")
        return text[:300]


def _message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
        if body.get("message"):
            return str(body["message"])
    with contextlib.suppress(Exception):
        return json.dumps(body)[:300] if body else str(exc)
    return str(exc)


def _is_overflow(text: str) -> bool:
    lower = text.lower()
    return any(
        word in lower
        for word in ("context length", "context window", "maximum context", "exceeds the available")
    )


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float) and value > 0:
        return int(value)
    return None
