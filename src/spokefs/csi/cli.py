"""``spokefs csi``: the CSI node driver (docs/kubernetes.md, "CSI driver")."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from pathlib import Path

from spokefs.errors import ConfigError
from spokefs.units import parse_duration

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    from spokefs.csi.service import DRIVER_NAME

    p = sub.add_parser(
        "csi", help="the Kubernetes CSI node driver: datasets as pod volumes",
        description="Serve the CSI Identity and Node services on a unix socket, for the "
        "kubelet: each published volume (a CSI ephemeral inline volume, or a PersistentVolume "
        "of this driver) is one `spokefs mount` process at the pod's target path, which "
        "outlives the driver, so restarting or upgrading it disturbs no volume. Volume "
        "attributes: dataset (required), snapshot (default: the latest at publish), spokeUrl "
        "(default --spoke-url), deadline; the key 'token' of nodePublishSecretRef's Secret is "
        "the volume's read token (else --token-file's, sent to --spoke-url only).",
        epilog="example:\n  spokefs --token-file /etc/spokefs/tokens/client.token csi "
        "--endpoint unix:///csi/csi.sock \\\n      --spoke-url https://spoke.spokefs.svc:8471 "
        "--node-id $NODE_NAME",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="unix:///csi/csi.sock", metavar="unix:///PATH",
                   help="the unix socket to serve (default unix:///csi/csi.sock)")
    p.add_argument("--node-id", default=None, metavar="NAME",
                   help="this node's name as NodeGetInfo reports it (default: the host name; "
                   "in Kubernetes, spec.nodeName)")
    p.add_argument("--state-dir", type=Path, default=Path("/var/lib/spokefs/csi"),
                   metavar="DIR",
                   help="where the driver keeps its published volumes, their tokens and "
                   "logs; keep it across restarts (a hostPath) so a new driver finds them "
                   "(default /var/lib/spokefs/csi)")
    p.add_argument("--spoke-url", default=None, metavar="URL",
                   help="the spoke a volume reads when its attributes name none, e.g. "
                   "https://spoke:8471; the only URL the driver's own token is sent to")
    p.add_argument("--driver-name", default=DRIVER_NAME, metavar="NAME",
                   help=f"the driver's name, as the CSIDriver object names it (default "
                   f"{DRIVER_NAME})")
    p.add_argument("--mount-timeout", type=parse_duration, default=60.0, metavar="DURATION",
                   help="how long a publish waits for its mount to answer (default 60s)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from spokefs.csi.service import NodeDriver, serve
    from spokefs.csi.volumes import CsiError, Volumes

    if args.mount_timeout <= 0:
        raise ConfigError("--mount-timeout must be positive")
    try:
        volumes = Volumes(args.state_dir, default_spoke=args.spoke_url,
                          mount_timeout=args.mount_timeout)
        driver = NodeDriver(volumes, args.node_id or socket.gethostname(), args.driver_name)
        server = serve(driver, args.endpoint)
    except (CsiError, OSError) as exc:
        raise ConfigError(f"csi: {exc}") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        volumes.recover()  # the calls are answered meanwhile; Probe says not ready
        driver.ready.set()
        print(f"spokefs csi listening on {args.endpoint} (driver {driver.name}, node "
              f"{driver.node_id}, {len(volumes.records())} volumes)", flush=True)
        stop.wait()
    finally:
        # The mounts stay: they are processes of their own, found again by the next driver.
        server.stop(grace=5).wait(10)
        log.info("csi: stopped; %d volumes stay mounted", len(volumes.records()))
    return 0
