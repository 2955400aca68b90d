"""A Ray auth token of a test's own, for this process (the driver) and the Ray nodes it starts.

Ray 2.60 turns token authentication on when ~/.ray/auth_token exists (and a local `ray.init()`
writes one when it does not), and every node and client of a cluster must present the same token.
A process reads its auth mode and token once and caches both (Ray's C++ `AuthenticationTokenLoader`
and `RayConfig`): changing RAY_AUTH_TOKEN in `os.environ` later does not change the token this
process presents. A test module that sets a token of its own after another module's Ray instance
(tests/test_ray.py then tests/test_ray_cluster.py in one pytest session) would present the stale one,
and `ray.init(address=...)` fails with "Failed to connect to Ray cluster at <ip>:<port>" (its cause:
`AuthenticationError: InvalidAuthToken`). So the context below reloads both after changing the
environment and again after restoring it, as Ray's own tests do
(`ray/_private/authentication_test_utils.py::reset_auth_token_state`: `Config.initialize("")`, then
`AuthenticationTokenLoader.instance().reset_cache()`, in that order).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

from tests.conftest import restore_environ

AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def reload_ray_auth() -> None:
    """Make this process read Ray's auth mode and token from the environment again."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # before dropping the cached token (see Ray's reset_auth_token_state)
    AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def own_ray_token() -> Iterator[str]:
    """Token mode with a fresh token in this process's environment (inherited by the nodes it starts);
    yields the token. Call it with no Ray instance up in this process; on exit the environment is as
    before and reloaded (shut Ray down first)."""
    old = {k: os.environ.get(k) for k in AUTH_ENV}
    token = secrets.token_hex(32)
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    reload_ray_auth()
    try:
        yield token
    finally:
        restore_environ(old)
        reload_ray_auth()
