"""An S3 protocol server in a child process, for the tests and benchmarks: moto in server mode
(real HTTP and the S3 wire protocol on 127.0.0.1), never a mock of a client library.

    with S3Server() as s3:        # python -m spokefs_bench.s3server, port 0
        s3.url                    # http://127.0.0.1:PORT, for --endpoint-url

moto comes with the ``test`` extra (``pip install 'moto[server]'``). It keeps objects in memory
(large ones in temporary files) and answers one request per thread: it is slower than S3 and
than the clients measured against it, so a benchmark reports the client's CPU, not moto's pace.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from spokefs.procs import Child

_READY = re.compile(r"^spokefs s3 listening on (http://\S+)")
# Keys the tests and benchmarks sign with; moto accepts any, a real store none of these.
TEST_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server(Child):
    """moto's S3 server as a child process on 127.0.0.1, a free port, ready when it says so.
    ``port`` may be given to come back on the same address after ``stop`` (a restart);
    ``env`` adds to the environment (``INITIAL_NO_AUTH_ACTION_COUNT=0``: moto checks every
    request's credentials, and knows none). Its output (a line per request) is in ``lines``."""

    def __init__(self, port: int = 0, log_path: Path | None = None,
                 env: dict[str, str] | None = None, keep_output: bool = True) -> None:
        super().__init__([sys.executable, "-m", "spokefs_bench.s3server", str(port)],
                         lambda line: _READY.match(line) is not None, name="moto s3",
                         log_path=log_path, env=env, keep_output=keep_output)
        self.url = ""

    def start(self, timeout: float = 60.0) -> S3Server:
        super().start(timeout)
        m = _READY.match(self.ready_line)
        assert m is not None
        self.url = m.group(1)
        return self

    def __enter__(self) -> S3Server:
        return self.start() if self.proc is None else self

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


def upload_tree(endpoint: str, bucket: str, root: Path, prefix: str,
                threads: int = 8, test_keys: bool = True) -> int:
    """Put every file under ``root`` into ``bucket`` as ``prefix/relative/path`` (the bucket
    is made if missing); returns the bytes put. For benchmarks: with the test keys, or
    (``test_keys=False``, a store of the user's) the credentials AWS tools find."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3

    if test_keys:
        c = boto3.client("s3", endpoint_url=endpoint, region_name=TEST_ENV["AWS_REGION"],
                         aws_access_key_id=TEST_ENV["AWS_ACCESS_KEY_ID"],
                         aws_secret_access_key=TEST_ENV["AWS_SECRET_ACCESS_KEY"])
    else:
        c = boto3.Session().client("s3", endpoint_url=endpoint)
    region = c.meta.region_name
    where = ({} if region in (None, "us-east-1")
             else {"CreateBucketConfiguration": {"LocationConstraint": region}})
    try:
        c.create_bucket(Bucket=bucket, **where)
    except c.exceptions.BucketAlreadyOwnedByYou:
        pass
    files = sorted(p for p in root.rglob("*") if p.is_file())

    def put(path: Path) -> int:
        body = path.read_bytes()
        c.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(root).as_posix()}",
                     Body=body)
        return len(body)

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(put, files))


def bucket_hub_args(bucket: str, prefix: str, state_dir: Path, endpoint: str) -> list[str]:
    """``spokefs hub serve s3://bucket/prefix`` on a free port (run it with ``TEST_ENV``)."""
    return ["hub", "serve", f"s3://{bucket}/{prefix}", "--port", "0", "--state-dir",
            str(state_dir), "--endpoint-url", endpoint]


def main(argv: list[str]) -> None:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        sys.exit("moto is not installed: pip install 'moto[server]' (the test extra)")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(argv[0]) if argv else 0,
                                verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    print(f"spokefs s3 listening on http://{host}:{port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        os._exit(0)  # moto's threads hold nothing worth a clean shutdown


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    main(sys.argv[1:])
