"""Rewards from an HTTP server: a reward entry with ``url:`` instead of ``function:``.

Protocol (one JSON POST a request, ``Content-Type: application/json``)::

    request:  {"prompts": [...], "completions": [...], "columns": {"answer": [...], ...}}
    response: {"rewards": [float | null, ...]}          one per completion, in order; null: does not apply

A batch of N completions is split into requests of ``batch_size`` completions (0: one request), at most
``max_concurrency`` in flight. A request that fails in a way that may pass on a second try (connection refused or
reset, a timeout, HTTP 429 or 5xx) is retried up to ``max_retries`` times, waiting ``retry_backoff_s · 2^k`` before
retry k+1 (or the server's ``Retry-After``, capped at 60 s). Any other failure (HTTP 4xx, a body that is not the
documented JSON, a wrong number of rewards) is not retried. The completions of a request that failed in the end get
no learning signal, each counted as a reward failure naming the server and the reason, like a function's.

The ``Authorization`` header's value comes from the environment variable named by ``auth_env``, never from the config
file (which is saved with every checkpoint). Only the standard library is used (urllib, a thread pool).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait

from ..config.validation import reward_url_problem

RETRYABLE_STATUS = (408, 429, 500, 502, 503, 504)
MAX_RETRY_AFTER_S = 60.0


class ServerRewardError(RuntimeError):
    """A reward server cannot be used as configured (a bad URL, a missing environment variable, unreachable)."""


class _Permanent(Exception):
    """A failed request that a retry would not fix."""


def check_url(url: str) -> urllib.parse.SplitResult:
    """The parsed URL, or ServerRewardError saying what a reward server's URL must be."""
    problem = reward_url_problem(url)
    if problem:
        raise ServerRewardError(f"{url!r}: expected {problem}")
    return urllib.parse.urlsplit(url)


def server_name(url: str) -> str:
    """The name a server's rewards are reported under: the URL path's last part, else the host."""
    parts = urllib.parse.urlsplit(url)
    return parts.path.rstrip("/").rsplit("/", 1)[-1] or parts.hostname or url


class ServerReward:
    """A reward server; :meth:`score` returns per-completion values and failures (see the module docstring)."""

    def __init__(self, url: str, *, timeout_s: float = 300.0, auth_env: str | None = None, batch_size: int = 0,
                 max_concurrency: int = 4, max_retries: int = 3, retry_backoff_s: float = 1.0):
        self.parts = check_url(url)
        self.url, self.timeout_s, self.batch_size = url, timeout_s, batch_size
        self.max_concurrency, self.max_retries, self.retry_backoff_s = max_concurrency, max_retries, retry_backoff_s
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if auth_env:
            value = os.environ.get(auth_env)
            if not value:
                raise ServerRewardError(f"auth_env: the environment variable {auth_env} is not set (its value is sent "
                                        "as the Authorization header, e.g. 'Bearer <token>')")
            self.headers["Authorization"] = value
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_concurrency), thread_name_prefix="longrl-reward-http")

    def check_reachable(self, timeout_s: float = 10.0) -> None:
        """Open (and close) a TCP connection to the server: an unreachable one fails before the model loads."""
        port = self.parts.port or (443 if self.parts.scheme == "https" else 80)
        try:
            socket.create_connection((self.parts.hostname, port), timeout=timeout_s).close()
        except OSError as e:
            raise ServerRewardError(f"{self.url}: cannot connect to {self.parts.hostname}:{port} ({e}); start the "
                                    "reward server first") from None

    # ------------------------------------------------------------------------------------------ one request
    def _post(self, body: bytes) -> dict:
        """One POST; the parsed JSON answer, or an exception: _Permanent, or a retryable error."""
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        timeout = self.timeout_s if self.timeout_s > 0 else None
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode("utf-8", "replace").strip()
            message = f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")
            if e.code in RETRYABLE_STATUS:
                raise _Retryable(message, _retry_after(e.headers.get("Retry-After"))) from None
            raise _Permanent(message) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise _Permanent(f"the response is not JSON: {raw[:120]!r}") from None

    def _request(self, prompts, completions, columns) -> list:
        """The rewards of one request's completions (after retries), or raise with the reason."""
        body = json.dumps({"prompts": prompts, "completions": completions, "columns": columns}, default=str).encode()
        attempt = 0
        while True:
            try:
                answer = self._post(body)
                return _rewards_of(answer, len(completions))
            except _Permanent:
                raise
            except (_Retryable, urllib.error.URLError, http.client.HTTPException, OSError) as e:  # refused, reset, timeout
                if attempt >= self.max_retries:
                    tries = f" (after {attempt + 1} attempts)" if attempt else ""
                    raise _Permanent(f"{_describe(e, self.timeout_s)}{tries}") from None
                wait_s = getattr(e, "retry_after", None)
                time.sleep(wait_s if wait_s is not None else self.retry_backoff_s * 2 ** attempt)
                attempt += 1

    # ------------------------------------------------------------------------------------------ a batch
    def score(self, prompts: list, completions: list, columns: dict[str, list]) -> tuple[list, list[tuple]]:
        """(values [N]: float, None or NaN for a failure; failures: (sample, reason) for each failed sample)."""
        n = len(completions)
        size = self.batch_size if self.batch_size > 0 else max(n, 1)
        chunks = [(start, min(start + size, n)) for start in range(0, n, size)]
        futures = {self._pool.submit(self._request, prompts[a:b], completions[a:b],
                                     {k: list(v[a:b]) for k, v in columns.items()}): (a, b) for a, b in chunks}
        wait(futures)
        values: list = [math.nan] * n
        failures: list[tuple] = []
        for future, (a, b) in futures.items():
            error = future.exception()
            if error is None:
                values[a:b] = future.result()
            else:
                reason = str(error) if isinstance(error, _Permanent) else f"{type(error).__name__}: {error}"
                failures += [(i, f"{self.url}: {reason}") for i in range(a, b)]
        return values, failures

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after(header: str | None) -> float | None:
    """Seconds of a Retry-After header given in seconds (an HTTP date is ignored), capped."""
    try:
        return min(max(float(header), 0.0), MAX_RETRY_AFTER_S) if header is not None else None
    except ValueError:
        return None


def _describe(error: BaseException, timeout_s: float) -> str:
    reason = getattr(error, "reason", None)  # URLError wraps the socket's error
    inner = reason if isinstance(reason, BaseException) else error
    if isinstance(inner, (TimeoutError, socket.timeout)):
        return f"no answer within {timeout_s:g} s (rewards[i].timeout_s)"
    return f"{type(inner).__name__}: {inner}" if not isinstance(inner, _Retryable) else str(inner)


def _rewards_of(answer, n: int) -> list:
    """The ``rewards`` list of a response: n finite numbers or nulls, else _Permanent naming what is wrong."""
    if not isinstance(answer, dict) or not isinstance(answer.get("rewards"), list):
        shown = json.dumps(answer)[:120]
        raise _Permanent(f'malformed response {shown}: expected {{"rewards": [number or null, ...]}}')
    rewards = answer["rewards"]
    if len(rewards) != n:
        raise _Permanent(f"malformed response: {len(rewards)} rewards for {n} completions")
    out = []
    for i, r in enumerate(rewards):
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)):
            raise _Permanent(f"malformed response: rewards[{i}] is {r!r}; expected a finite number or null")
        out.append(None if r is None else float(r))
    return out
