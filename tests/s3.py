"""A local S3-compatible server for the tests: moto's server, started by the test on 127.0.0.1.

Ranks reach it the way a job reaches a real bucket: through environment variables (credentials, and
``AWS_ENDPOINT_URL``, which botocore and so s3fs read), handed to spawned ranks with ``run_ranks(env=...)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """Start the server; yield the environment that points S3 clients at it (also set in this process)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _forget_clients()
    try:
        yield env
    finally:
        server.stop()
        _forget_clients()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _forget_clients() -> None:
    """fsspec caches file-system instances: one made for an earlier server must not be reused."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def make_bucket(name: str) -> None:
    import s3fs

    s3fs.S3FileSystem().mkdir(name)
