"""The CSI node driver (``spokefs csi``), for real: the driver as a process on a unix socket, a
hub and a spoke as processes, and a gRPC client built from the driver's CSI messages sending
what a kubelet sends (publish, unpublish, the identity calls, bad requests).

The messages are checked against csi.proto (compiled by grpcio-tools where installed) and
against the spec's field numbers, so a real kubelet reads them alike. Publishing mounts with
FUSE: those tests need root and a usable /dev/fuse and are skipped with the reason otherwise.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from servers import ServerProcess, hub, make_dataset, spoke
from spokefs.client.sync import Client
from spokefs.mount import sysfs
from spokefs.mount.process import fuse_unusable
from spokefs.procs import Child, cli

grpc = pytest.importorskip("grpc", reason="grpcio (the csi extra) is not installed")
pytest.importorskip("google.protobuf", reason="protobuf (the csi extra) is not installed")

from spokefs.csi import messages as m  # noqa: E402 (needs protobuf)
from spokefs.csi.service import CsiClient  # noqa: E402
from spokefs.csi.volumes import InvalidArgument, parse_request  # noqa: E402

FUSE_REASON = fuse_unusable()
needs_fuse = pytest.mark.skipif(FUSE_REASON is not None, reason=f"no FUSE: {FUSE_REASON}")
CSI_PROTO = Path(__file__).resolve().parent.parent / "src" / "spokefs" / "csi" / "csi.proto"
READY = "spokefs csi listening on"


# -- the messages ------------------------------------------------------------------------------
def test_messages_are_what_csi_proto_declares(tmp_path: Path) -> None:
    """The descriptors built at runtime are csi.proto's, field for field (json names and
    empty method options aside: protoc fills those in, nothing reads them)."""
    protoc = pytest.importorskip("grpc_tools.protoc",
                                 reason="grpcio-tools compiles csi.proto for this check")
    from google.protobuf import descriptor_pb2

    out = tmp_path / "csi.pb"
    include = Path(protoc.__file__).parent / "_proto"
    assert protoc.main(["protoc", f"-I{CSI_PROTO.parent}", f"-I{include}",
                        f"--descriptor_set_out={out}", str(CSI_PROTO)]) == 0
    (compiled,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file

    def plain(fd: Any) -> Any:
        fd = descriptor_pb2.FileDescriptorProto.FromString(fd.SerializeToString())

        def walk(msgs: Any) -> None:
            for msg in msgs:
                for f in msg.field:
                    f.ClearField("json_name")
                walk(msg.nested_type)

        walk(fd.message_type)
        for s in fd.service:
            for method in s.method:
                method.ClearField("options")
        return fd

    assert plain(compiled) == plain(m.FILE)


# (message, field, number) as the CSI spec (csi.proto v1.x) numbers them: what goes on the wire
SPEC_FIELDS = [
    ("GetPluginInfoResponse", "name", 1), ("GetPluginInfoResponse", "vendor_version", 2),
    ("GetPluginInfoResponse", "manifest", 3), ("ProbeResponse", "ready", 1),
    ("GetPluginCapabilitiesResponse", "capabilities", 1),
    ("NodePublishVolumeRequest", "volume_id", 1),
    ("NodePublishVolumeRequest", "publish_context", 2),
    ("NodePublishVolumeRequest", "staging_target_path", 3),
    ("NodePublishVolumeRequest", "target_path", 4),
    ("NodePublishVolumeRequest", "volume_capability", 5),
    ("NodePublishVolumeRequest", "readonly", 6), ("NodePublishVolumeRequest", "secrets", 7),
    ("NodePublishVolumeRequest", "volume_context", 8),
    ("NodeUnpublishVolumeRequest", "volume_id", 1),
    ("NodeUnpublishVolumeRequest", "target_path", 2),
    ("NodeGetInfoResponse", "node_id", 1), ("NodeGetInfoResponse", "max_volumes_per_node", 2),
    ("NodeGetInfoResponse", "accessible_topology", 3),
    ("NodeGetCapabilitiesResponse", "capabilities", 1),
    ("VolumeCapability", "block", 1), ("VolumeCapability", "mount", 2),
    ("VolumeCapability", "access_mode", 3),
    ("VolumeCapability.MountVolume", "fs_type", 1),
    ("VolumeCapability.MountVolume", "mount_flags", 2),
    ("VolumeCapability.AccessMode", "mode", 1),
]


@pytest.mark.parametrize(("message", "name", "number"), SPEC_FIELDS)
def test_fields_have_the_specs_numbers(message: str, name: str, number: int) -> None:
    assert m.message(message).DESCRIPTOR.fields_by_name[name].number == number


def test_a_publish_request_reads_back_from_the_wire() -> None:
    req = m.NodePublishVolumeRequest(volume_id="csi-1", target_path="/t",
                                     volume_context={"dataset": "ds"}, secrets={"token": "s"})
    req.volume_capability.access_mode.mode = m.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
    req.volume_capability.mount.SetInParent()
    wire = req.SerializeToString()
    # field 8 (volume_context), a length-delimited map entry: tag (8 << 3) | 2 = 0x42
    assert b"\x42" in wire
    back = m.NodePublishVolumeRequest.FromString(wire)
    assert back == req and back.volume_capability.HasField("mount")


# -- checking a publish's arguments ------------------------------------------------------------
def _parse(context: dict[str, str], *, secrets: dict[str, str] | None = None,
           block: bool = False, flags: list[str] | None = None, volume_id: str = "v1",
           target: str = "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/d/mount",
           default: str | None = "http://spoke:8471") -> Any:
    return parse_request(volume_id, target, context, secrets or {}, block=block,
                         mount_flags=flags or [], default_spoke=default)


def test_volume_attributes() -> None:
    spec = _parse({"dataset": "imagenet", "csi.storage.k8s.io/pod.name": "train-0",
                   "csi.storage.k8s.io/ephemeral": "true"})
    assert spec.url == "http://spoke:8471/imagenet" and spec.token is None
    spec = _parse({"dataset": "imagenet", "snapshot": "3fa9c1d20b7e",
                   "spokeUrl": "https://other:8471/", "deadline": "1m"},
                  secrets={"token": "abc\n"})
    assert spec.url == "https://other:8471/imagenet@3fa9c1d20b7e"
    assert spec.deadline == "1m" and spec.token == "abc"
    assert "abc" not in repr(spec)  # a token is never shown
    # dataset "*": the namespace, a folder per dataset the token may read
    spec = _parse({"dataset": "*"})
    assert spec.namespace and spec.url == "http://spoke:8471/"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"context": {}}, "volume attribute 'dataset' is required"),
    ({"context": {"dataset": "../etc"}}, "volume attribute 'dataset'"),
    ({"context": {"dataset": "ds", "snapshot": "a/b"}}, "volume attribute 'snapshot'"),
    ({"context": {"dataset": "*", "snapshot": "abc"}}, "a namespace volume"),
    ({"context": {"dataset": "ds", "datset": "x"}}, "unknown volume attribute 'datset'"),
    ({"context": {"dataset": "ds", "spokeUrl": "ftp://x"}}, "volume attribute 'spokeUrl'"),
    ({"context": {"dataset": "ds"}, "default": None}, "volume attribute 'spokeUrl' is required"),
    ({"context": {"dataset": "ds", "deadline": "soon"}}, "volume attribute 'deadline'"),
    ({"context": {"dataset": "ds"}, "block": True}, "block access is not supported"),
    ({"context": {"dataset": "ds"}, "volume_id": ""}, "volume_id is required"),
    ({"context": {"dataset": "ds"}, "target": "relative/path"}, "target_path"),
    ({"context": {"dataset": "ds"}, "secrets": {"password": "hunter2"}},
     "keys spokefs does not read"),
])
def test_bad_volume_attributes_name_what_is_wrong(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as info:
        _parse(**kwargs)
    assert "hunter2" not in str(info.value)  # a secret's keys may be named, never its values


# -- the driver as a process -------------------------------------------------------------------
class Driver(Child):
    """``spokefs csi`` on a unix socket in ``work``, ready when it prints its listening line."""

    def __init__(self, work: Path, spoke_url: str | None, *extra: str) -> None:
        self.endpoint = f"unix://{work / 'csi.sock'}"
        args = ["csi", "--endpoint", self.endpoint, "--state-dir", str(work / "state"),
                "--node-id", "node-a", *extra]
        if spoke_url:
            args += ["--spoke-url", spoke_url]
        super().__init__(cli(*args), lambda line: line.startswith(READY), name="spokefs csi")

    def client(self) -> CsiClient:
        return CsiClient(self.endpoint)


@pytest.fixture
def work() -> Iterator[Path]:
    # a short folder: a unix socket's path is limited to 107 bytes, pytest's tmp_path is long
    path = Path(tempfile.mkdtemp(prefix="csi-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _code(call: Any, *args: Any, **kwargs: Any) -> tuple[Any, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()


def test_identity_and_node_info_without_a_spoke(work: Path) -> None:
    with Driver(work, None) as driver, driver.client() as c:
        info = c.call("GetPluginInfo")
        assert info.name == "csi.spokefs.io" and info.vendor_version
        caps = c.call("GetPluginCapabilities")
        assert list(caps.capabilities) == []  # no controller service: nothing to provision
        assert c.call("Probe").ready.value is True
        assert c.call("NodeGetInfo").node_id == "node-a"
        assert list(c.call("NodeGetCapabilities").capabilities) == []  # no staging
        # bad requests are refused before anything is started, naming what is wrong
        code, details = _code(c.call, "NodePublishVolume", target_path=f"{work}/t")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "volume_id" in details
        req = _publish_request("v1", work / "t", {"dataset": "ds"})
        code, details = _code(c.call, "NodePublishVolume", req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "'spokeUrl' is required" in details
        req.volume_context["spokeUrl"] = "http://127.0.0.1:9"
        req.volume_context["snapshotId"] = "x"
        code, details = _code(c.call, "NodePublishVolume", req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "'snapshotId'" in details
        del req.volume_context["snapshotId"]
        req.volume_capability.block.SetInParent()
        code, details = _code(c.call, "NodePublishVolume", req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "block" in details
        req.ClearField("volume_capability")
        code, details = _code(c.call, "NodePublishVolume", req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "volume_capability" in details
        code, details = _code(c.call, "NodeUnpublishVolume", volume_id="v1")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "target_path" in details
        # unpublishing what was never published is not an error (CSI: idempotent)
        c.call("NodeUnpublishVolume", volume_id="v1", target_path=f"{work}/never")
        assert not list((work / "state" / "volumes").iterdir())
    # a second driver on the same socket while the first serves is refused; a stale socket
    # file left by a dead driver is replaced
    with Driver(work, None) as first:
        second = Driver(work, None)
        with pytest.raises(Exception, match="another driver is serving"):
            second.start(30)
        first.kill()
        assert (work / "csi.sock").is_socket()
        with Driver(work, None) as again, again.client() as c:
            assert c.call("Probe").ready.value is True


def _publish_request(volume_id: str, target: Path, context: dict[str, str],
                     secrets: dict[str, str] | None = None) -> Any:
    """A NodePublishVolume as a kubelet sends it for a CSI volume (single node writer, read
    only, a mount capability), with the pod's attributes (podInfoOnMount)."""
    req = m.NodePublishVolumeRequest(volume_id=volume_id, target_path=str(target),
                                     readonly=True, volume_context=context,
                                     secrets=secrets or {})
    req.volume_context.update({"csi.storage.k8s.io/pod.name": "train-0",
                               "csi.storage.k8s.io/pod.namespace": "ml",
                               "csi.storage.k8s.io/ephemeral": "true"})
    req.volume_capability.mount.SetInParent()
    req.volume_capability.access_mode.mode = m.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
    return req


# -- publishing, for real ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProcess]]:
    if FUSE_REASON is not None:
        pytest.skip(f"no FUSE: {FUSE_REASON}")
    root = tmp_path_factory.mktemp("csistack")
    ds = make_dataset(root / "ds", n_small=8, big_sizes=(3_000_000,))
    with hub(ds, root / "hubstate") as h, spoke(h.url, root / "cache", "1GiB",
                                                "--deadline", "5s") as s:
        yield ds, s


def _target(work: Path, pod: str, volume: str) -> Path:
    """Where a kubelet publishes a pod's CSI volume; it makes the parent, the driver the rest."""
    parent = work / "kubelet" / "pods" / pod / "volumes" / "kubernetes.io~csi" / volume
    parent.mkdir(parents=True)
    return parent / "mount"


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _mount_pids(target: Path) -> list[int]:
    """The processes whose command line ends with ``target``: the volume's mount processes."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and b"mount" in args and str(target).encode() in args:
            pids.append(int(proc.name))
    return pids


def _gone(pid: int, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)  # another process's exit: nothing to block on
    return False


@needs_fuse
def test_publish_read_restart_unpublish(stack: tuple[Path, ServerProcess], work: Path) -> None:
    ds, s = stack
    snap = Client(s.url).resolve("ds", "latest")
    a = _target(work, "pod-a", "data")
    b = _target(work, "pod-b", "pinned")
    driver = Driver(work, s.url).start()
    try:
        with driver.client() as c:
            # an inline ephemeral volume naming only the dataset: the driver's --spoke-url
            c.call("NodePublishVolume", _publish_request("csi-a", a, {"dataset": "ds"}))
            assert sysfs.is_mounted(a)
            assert _sha(a / "class1" / "img0001.jpg") == _sha(ds / "class1" / "img0001.jpg")
            (pid_a,) = _mount_pids(a)
            # the same publish again: OK, and still one process for the volume
            c.call("NodePublishVolume", _publish_request("csi-a", a, {"dataset": "ds"}))
            assert _mount_pids(a) == [pid_a]
            # another volume at the same target: refused, the first untouched
            code, details = _code(c.call, "NodePublishVolume",
                                  _publish_request("csi-x", a, {"dataset": "ds"}))
            assert code == grpc.StatusCode.ALREADY_EXISTS and "csi-a" in details
            # a second volume beside it: a pinned snapshot, the spoke named in its attributes
            c.call("NodePublishVolume", _publish_request(
                "csi-b", b, {"dataset": "ds", "snapshot": snap, "spokeUrl": s.url}))
            assert _sha(b / "shards" / "shard-000.tar") == _sha(ds / "shards" / "shard-000.tar")
            (pid_b,) = _mount_pids(b)
            assert pid_b != pid_a
            # the namespace: every dataset a folder; unpublished again at once
            n = _target(work, "pod-n", "all")
            c.call("NodePublishVolume", _publish_request("csi-n", n, {"dataset": "*"}))
            assert os.listdir(n) == ["ds"]
            assert _sha(n / "ds" / "class1" / "img0001.jpg") == \
                _sha(ds / "class1" / "img0001.jpg")
            c.call("NodeUnpublishVolume", volume_id="csi-n", target_path=str(n))
            assert not sysfs.is_mounted(n)

        # the driver dies while a file of volume a is open: the file stays readable
        held = open(a / "shards" / "shard-000.tar", "rb")  # noqa: SIM115 (held across steps)
        head = held.read(1 << 20)
        driver.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        driver.wait(10)
        expected = (ds / "shards" / "shard-000.tar").read_bytes()
        assert head == expected[: 1 << 20]
        assert held.read() == expected[1 << 20:]
        assert _sha(a / "class2" / "img0002.jpg") == _sha(ds / "class2" / "img0002.jpg")

        # a new driver finds both volumes, as they are: same processes, nothing remounted
        driver = Driver(work, s.url).start()
        assert "2 volumes" in driver.ready_line
        assert _mount_pids(a) == [pid_a] and _mount_pids(b) == [pid_b]
        held.seek(0)
        assert held.read(4096) == expected[:4096]
        held.close()
        with driver.client() as c:
            c.call("NodePublishVolume", _publish_request("csi-a", a, {"dataset": "ds"}))
            assert _mount_pids(a) == [pid_a]
            # a mismatched volume id at a target is NOT_FOUND, and leaves the volume alone
            code, _ = _code(c.call, "NodeUnpublishVolume", volume_id="csi-b", target_path=str(a))
            assert code == grpc.StatusCode.NOT_FOUND and sysfs.is_mounted(a)
            # unpublish works after the restart; again, it is a no-op
            for volume_id, target, pid in (("csi-a", a, pid_a), ("csi-b", b, pid_b)):
                c.call("NodeUnpublishVolume", volume_id=volume_id, target_path=str(target))
                assert not sysfs.is_mounted(target) and not target.exists()
                assert _gone(pid), f"the mount process {pid} of {target} is still running"
                c.call("NodeUnpublishVolume", volume_id=volume_id, target_path=str(target))
            assert not list((work / "state" / "volumes").iterdir())
    finally:
        driver.stop()
        for t in (a, b):
            if sysfs.is_mounted(t):
                os.system(f"fusermount3 -u -z {t}")


@needs_fuse
def test_a_restarted_driver_mounts_again_what_died(stack: tuple[Path, ServerProcess],
                                                   work: Path) -> None:
    ds, s = stack
    a = _target(work, "pod-a", "data")
    try:
        with Driver(work, s.url) as driver, driver.client() as c:
            c.call("NodePublishVolume", _publish_request("csi-a", a, {"dataset": "ds"}))
            (pid,) = _mount_pids(a)
        # the driver is stopped (SIGTERM): the mount stays
        assert sysfs.is_mounted(a) and _mount_pids(a) == [pid]
        os.kill(pid, signal.SIGKILL)  # then its process dies: a dead mount
        assert _gone(pid)
        with pytest.raises(OSError):
            os.listdir(a)
        with Driver(work, s.url) as driver, driver.client() as c:
            (new,) = _mount_pids(a)
            assert new != pid
            assert _sha(a / "class3" / "img0003.jpg") == _sha(ds / "class3" / "img0003.jpg")
            c.call("NodeUnpublishVolume", volume_id="csi-a", target_path=str(a))
            assert not sysfs.is_mounted(a) and _gone(new)
    finally:
        if sysfs.is_mounted(a):
            os.system(f"fusermount3 -u -z {a}")


@needs_fuse
def test_what_the_spoke_refuses(stack: tuple[Path, ServerProcess], work: Path) -> None:
    _, s = stack
    with Driver(work, s.url) as driver, driver.client() as c:
        t = _target(work, "pod-a", "data")
        code, details = _code(c.call, "NodePublishVolume",
                              _publish_request("v1", t, {"dataset": "nope"}))
        assert code == grpc.StatusCode.NOT_FOUND and "'nope'" in details
        code, details = _code(c.call, "NodePublishVolume",
                              _publish_request("v1", t, {"dataset": "ds",
                                                         "snapshot": "000000000000"}))
        assert code == grpc.StatusCode.NOT_FOUND and "000000000000" in details
        assert not sysfs.is_mounted(t) and not _mount_pids(t)
        assert not list((work / "state" / "volumes").iterdir())
