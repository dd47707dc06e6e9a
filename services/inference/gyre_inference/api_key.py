"""`ServerKey`: the API key (and the control token) the server asks for, taken up again when its file is rotated in
place.

`auth.api_key_file` is usually a mounted Kubernetes Secret, and the kubelet rewrites that file when the Secret is
updated (no pod restart). Read once, the new key was refused with 401 and the old one accepted until the pod
restarted. Now the file is read again:

- at most every `REREAD_S` seconds on requests that carry the current key, so a rotation also retires the old key
  (after the grace below) without anyone presenting the new one first;
- at once on a request whose key matches neither the current nor the previous key, so the first request with the
  new key is accepted (a wrong key costs one read of a small file, then its 401).

The previous key stays valid for `GRACE_S` seconds after the server took up a new one: the kubelet updates each pod's
copy of a Secret on its own schedule (up to about a minute apart), and a client (the orchestrator re-reads its key
only after a 401: `gyre.endpoint.RotatingKey`) whose copy is still the old one would otherwise fail in between.
A file that cannot be read or is empty keeps the key in force (logged): a half-done rotation never opens the server.

`auth.control_token_file` is read the same way by the gRPC control server (`gyre.grpc_server` takes a `ServerKey`
for its token): the orchestrator's relay re-reads its token after an UNAUTHENTICATED answer, and every weight update
was refused until this pod restarted.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: how often a request with the current key checks the file (the kubelet itself takes up to a minute to rewrite it)
REREAD_S = 5.0
#: how long the previous key is still accepted after a rotation (kubelets update pods' copies up to ~1 min apart)
GRACE_S = 120.0


class ServerKey:
    """The bearer key of the API routes; `reread` reads the key again (None: a key given as such, never re-read)."""

    def __init__(self, key: str, reread: Callable[[], str | None] | None = None, *, name: str = "auth.api_key",
                 grace_s: float = GRACE_S, reread_s: float = REREAD_S,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.name = name
        self._current = key
        self._previous: str | None = None
        self._previous_until = 0.0
        self._reread, self._grace_s, self._reread_s, self._clock = reread, grace_s, reread_s, clock
        self._read_at = clock()
        self._unreadable: str | None = None  # the last read's error, logged once

    def accepts(self, authorization: str) -> bool:
        """Whether an `Authorization` header value is `Bearer <a key in force>`."""
        now = self._clock()
        if self._matches(authorization, self._current):
            if self._reread is not None and now - self._read_at >= self._reread_s:
                self._read(now)  # may rotate: the key just matched stays valid for the grace
            return True
        if self._reread is not None:
            self._read(now)
            if self._matches(authorization, self._current):
                return True
        return self._previous is not None and now < self._previous_until and self._matches(authorization,
                                                                                           self._previous)  # fmt: skip

    @staticmethod
    def _matches(authorization: str, key: str) -> bool:
        return hmac.compare_digest(authorization.encode(), f"Bearer {key}".encode())

    def _read(self, now: float) -> None:
        self._read_at = now
        try:
            fresh = self._reread()
        except ValueError as error:  # gone or empty mid-rotation: the key in force stays
            if str(error) != self._unreadable:
                log.warning("%s: %s; still asking for the key read before", self.name, error)
                self._unreadable = str(error)
            return
        self._unreadable = None
        if fresh is None or fresh == self._current:
            return
        self._previous, self._previous_until, self._current = self._current, now + self._grace_s, fresh
        log.info("%s: the file changed; the new key is in force, the previous one is accepted for %.0f s more",
                 self.name, self._grace_s)  # fmt: skip
