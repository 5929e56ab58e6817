"""A real Apache Kafka cluster on 127.0.0.1, fetched from Maven Central.

The jars are resolved once with the machine's ``mvn`` into ``<cache_dir>/kafka/<version>/libs`` and
reused; only the small ``pom.xml`` beside this file lives in the project. The cluster is one or more
combined KRaft nodes (broker + controller, one quorum of all of them), each in its own session so it
outlives the CLI that started it; every node (pid, ports, log) and the comma-separated bootstrap list are
recorded in ``<state_dir>/kafka/broker.json``, where the CLI, the worker and the tests find them.

``secure=True`` serves SASL_SSL only (SCRAM-SHA-512 for clients and brokers, PLAIN for the controller
listener; ``node_config.py``), with the project's own CA (``tls.py``), one SCRAM user per principal
(``credentials.py``) and the ACL table of ``acls.py``. A state directory keeps the shape it was
formatted with (``layout.json``): a one-node plaintext directory is not silently reused as a secure
three-node one.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import broker
from ..kafka_clients import Secret
from ..settings import Settings
from . import acls, replication
from .credentials import ADMIN, MECHANISM, ensure_credentials
from .node_config import NodeAddress, Security, admin_client_properties, render
from .tls import TlsError, TlsFiles, ensure_certificates

HERE = Path(__file__).resolve().parent
COMPLETE_MARKER = ".complete"
MULTI_NODE_HEAP_MB = 512  # per node when there are several: three JVMs share a small machine
FORMAT_TIMEOUT_S = 180.0
STATUS_TIMEOUTS_S = (2.0, 15.0)  # a metadata answer over SASL_SSL can take seconds on a loaded machine
USERS_TIMEOUT_S = 60.0


class DevstackError(RuntimeError):
    """The local cluster could not be fetched, started or reached."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: int
    pid: int
    port: int
    controller_port: int
    properties: str
    data_dir: str
    log_path: str


@dataclass(frozen=True)
class ClusterInfo:
    bootstrap: str          # every node's client listener, comma-separated
    version: str
    secure: bool
    started_at: float
    nodes: tuple[NodeInfo, ...] = field(default_factory=tuple)
    ca_file: str = ""       # the CA clients trust (secure clusters)

    @property
    def pid(self) -> int:
        """The first node's process (the only one of a one-node cluster)."""
        return self.nodes[0].pid

    def node(self, node_id: int) -> NodeInfo:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise DevstackError(f"no node {node_id}; the cluster has {[n.node_id for n in self.nodes]}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ClusterInfo":
        raw = json.loads(text)
        if "nodes" not in raw:  # recorded by a one-node devstack before clusters
            port = int(raw["bootstrap"].rsplit(":", 1)[1])
            props = str(Path(raw["data_dir"]).parent / "server.properties")
            raw = {"bootstrap": raw["bootstrap"], "version": raw["version"], "secure": False,
                   "started_at": raw["started_at"],
                   "nodes": [{"node_id": 1, "pid": raw["pid"], "port": port, "controller_port": raw["controller_port"],
                              "properties": props, "data_dir": raw["data_dir"], "log_path": raw["log_path"]}]}
        raw["nodes"] = tuple(NodeInfo(**n) for n in raw["nodes"])
        return cls(**raw)


@dataclass(frozen=True)
class Layout:
    """What a state directory was formatted as."""
    brokers: int
    secure: bool
    cluster_id: str


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    return ports


def _tool(name: str) -> str:
    if name == "java" and os.environ.get("JAVA_HOME"):
        candidate = Path(os.environ["JAVA_HOME"]) / "bin" / "java"
        if candidate.exists():
            return str(candidate)
    path = shutil.which(name)
    if not path:
        raise DevstackError(f"`{name}` is not on PATH; the Kafka devstack needs Java 17+ and Maven")
    return path


def _listening(bootstrap: str) -> str:
    """The addresses of ``bootstrap`` that accept a connection (so a stopped node's is not tried and logged)."""
    open_ = []
    for address in bootstrap.split(","):
        host, port = address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            open_.append(address)
        except OSError:
            continue
    return ",".join(open_)


async def _metadata_brokers(bootstrap: str, timeout_s: float, client_options: dict[str, Any]) -> set[int] | None:
    """Node ids the cluster's metadata lists, or None when nobody answers."""
    from aiokafka import AIOKafkaClient

    bootstrap = _listening(bootstrap)
    if not bootstrap:
        return None
    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000), **client_options)
    try:
        await asyncio.wait_for(client.bootstrap(), timeout_s)
        return {b.nodeId for b in client.cluster.brokers()}
    except Exception:
        return None
    finally:
        await client.close()


def answers_metadata(bootstrap: str, timeout_s: float = 2.0, client_options: dict[str, Any] | None = None) -> bool:
    """True when a broker at ``bootstrap`` answers a metadata request."""
    return asyncio.run(_metadata_brokers(bootstrap, timeout_s, client_options or {})) is not None


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace ``path`` with ``text`` whole: a reader never sees it half-written."""
    staging = path.with_name(f"{path.name}.partial-{os.getpid()}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    staging.rename(path)


def _argfile_quote(arg: str) -> str:
    if '"' in arg or "\\" in arg:
        raise DevstackError("an argument with a quote or a backslash cannot go in a java @argfile")
    return f'"{arg}"'


def _new_cluster_id() -> str:
    """Kafka's cluster id format (what ``kafka-storage random-uuid`` prints), without a JVM."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


class KafkaDevstack:
    """One state directory's cluster: ``brokers`` nodes, plaintext or ``secure``.

    ``brokers``/``secure`` left as None take what the directory was formatted with (else 1, plaintext).
    """

    def __init__(self, settings: Settings, brokers: int | None = None, secure: bool | None = None) -> None:
        self.version = settings.kafka_version
        self.libs_dir = settings.cache_dir / "kafka" / self.version / "libs"
        self.home = settings.kafka_dir
        self.info_path = broker.address_file(settings)
        self.layout_path = self.home / "layout.json"
        self.tls_dir = self.home / "tls"
        recorded = self._recorded_layout()
        self.brokers = brokers if brokers is not None else (recorded.brokers if recorded else 1)
        self.secure = secure if secure is not None else (recorded.secure if recorded else False)
        if self.brokers < 1:
            raise DevstackError(f"--brokers must be at least 1, got {self.brokers}")
        self.heap_mb = settings.kafka_heap_mb if self.brokers == 1 else min(settings.kafka_heap_mb,
                                                                              MULTI_NODE_HEAP_MB)

    # -- jars ---------------------------------------------------------------------------------------

    def fetched(self) -> bool:
        return (self.libs_dir / COMPLETE_MARKER).exists()

    def fetch(self) -> bool:
        """Resolve the broker's jars into the cache; False when they were already there."""
        if self.fetched():
            return False
        staging = self.libs_dir.with_name(f"libs.partial-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(parents=True, exist_ok=True)
        cmd = [_tool("mvn"), "-B", "-q", "-f", str(HERE / "pom.xml"),
               f"-Dkafka.version={self.version}", "dependency:copy-dependencies",
               f"-DoutputDirectory={staging}", "-DincludeScope=runtime"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise DevstackError(f"mvn could not resolve Kafka {self.version}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        if not list(staging.glob(f"kafka_2.13-{self.version}.jar")):
            raise DevstackError(f"mvn finished but kafka_2.13-{self.version}.jar is not in {staging}")
        (staging / COMPLETE_MARKER).write_text(self.version)
        if self.fetched():  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
            return True
        shutil.rmtree(self.libs_dir, ignore_errors=True)
        staging.rename(self.libs_dir)
        return True

    # -- what is recorded ---------------------------------------------------------------------------

    def info(self) -> ClusterInfo | None:
        try:
            return ClusterInfo.from_json(self.info_path.read_text())
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def _recorded_layout(self) -> Layout | None:
        try:
            return Layout(**json.loads(self.layout_path.read_text()))
        except (OSError, ValueError, TypeError):
            pass
        if (self.home / "data" / "meta.properties").exists():  # formatted before layouts were recorded
            return Layout(brokers=1, secure=False, cluster_id="")
        return None

    def _node_dir(self, node_id: int) -> Path:
        return self.home if self.brokers == 1 else self.home / f"node-{node_id}"

    def _alive(self, node: NodeInfo) -> bool:
        try:
            cmdline = Path(f"/proc/{node.pid}/cmdline").read_bytes()
        except OSError:
            return False
        return b"kafka.Kafka" in cmdline and node.properties.encode() in cmdline

    def status(self) -> str:
        """``running`` (every node alive and the cluster answering), ``dead`` (recorded, but a node is
        gone or nobody answers) or ``stopped`` (nothing recorded).

        With every node process alive, a slow answer is asked again with a longer timeout before the
        cluster is called dead (``start`` replaces a dead cluster): a SASL_SSL handshake and metadata
        request can take more than two seconds on a loaded machine."""
        info = self.info()
        if info is None:
            return "stopped"
        if not all(self._alive(n) for n in info.nodes):
            return "dead"
        options = self.client_options()
        for timeout_s in STATUS_TIMEOUTS_S:
            if answers_metadata(info.bootstrap, timeout_s=timeout_s, client_options=options):
                return "running"
            if not all(self._alive(n) for n in info.nodes):
                break
        return "dead"

    # -- security -----------------------------------------------------------------------------------

    def _security(self) -> Security | None:
        if not self.secure:
            return None
        try:
            tls = ensure_certificates(self.tls_dir)
        except TlsError as exc:
            raise DevstackError(str(exc)) from None
        return Security(tls=tls, admin_password=ensure_credentials(self.home)[ADMIN])

    def credentials(self) -> dict[str, str]:
        """principal → SCRAM password (secure clusters)."""
        if not self.secure:
            raise DevstackError("a plaintext devstack has no credentials; start it with --secure")
        return ensure_credentials(self.home)

    @property
    def ca_file(self) -> Path:
        return TlsFiles.under(self.tls_dir).ca

    def client_options(self, principal: str = ADMIN) -> dict[str, Any]:
        """aiokafka keyword arguments to connect as ``principal`` (nothing for a plaintext cluster)."""
        if not self.secure:
            return {}
        from aiokafka.helpers import create_ssl_context

        return {"security_protocol": "SASL_SSL", "sasl_mechanism": MECHANISM, "sasl_plain_username": principal,
                "sasl_plain_password": Secret(self.credentials()[principal]),
                "ssl_context": create_ssl_context(cafile=str(self.ca_file))}

    def apply_acls(self, settings: Settings) -> None:
        """Grant the principals what ``acls.acl_table(settings)`` says (idempotent)."""
        info = self.info()
        if not self.secure or info is None:
            raise DevstackError("ACLs need a running secure devstack")
        self._admin_tool(info, acls.acl_table(settings), {})

    def _admin_tool(self, info: ClusterInfo, table: list[acls.Acl], users: dict[str, str]) -> None:
        """Run ``ApplyAcls.java`` as ``admin``: SCRAM ``users`` (name → password, on its stdin) and ACLs."""
        security = self._security()
        assert security is not None
        properties = self.home / "admin-client.properties"
        _write_atomic(properties, admin_client_properties(security), mode=0o600)
        try:
            acls.apply_acls(self._java_command(heap_mb=256), _listening(info.bootstrap) or info.bootstrap,
                            properties, table, users)
        except acls.AclError as exc:
            raise DevstackError(str(exc)) from None

    def ensure_users(self, info: ClusterInfo, timeout_s: float = USERS_TIMEOUT_S) -> list[str]:
        """Make every principal of ``credentials.json`` but ``admin`` (formatted into the storage) a SCRAM
        user with its password, unless it already logs in; returns those created. Waits until each of
        them logs in at every node (a node learns a credential from the metadata log a moment later)."""
        credentials = self.credentials()
        missing = {name: password for name, password in credentials.items()
                   if name != ADMIN and not self._logs_in(info.bootstrap, name, 5.0)}
        if not missing:
            return []
        self._admin_tool(info, [], missing)
        deadline = time.monotonic() + timeout_s
        waiting = [(name, f"127.0.0.1:{node.port}") for name in missing for node in info.nodes]
        while waiting:
            waiting = [(name, address) for name, address in waiting if not self._logs_in(address, name, 5.0)]
            if waiting and time.monotonic() > deadline:
                raise DevstackError(f"SCRAM users not accepted within {timeout_s:.0f}s: {waiting}")
            if waiting:
                time.sleep(0.5)
        return sorted(missing)

    def _logs_in(self, bootstrap: str, principal: str, timeout_s: float) -> bool:
        """Whether ``principal`` authenticates (a refusal is the expected answer here: not logged)."""
        quiet = logging.getLogger("aiokafka")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            return asyncio.run(_metadata_brokers(bootstrap, timeout_s, self.client_options(principal))) is not None
        finally:
            quiet.setLevel(level)

    # -- starting and stopping ----------------------------------------------------------------------

    def _java_command(self, heap_mb: int | None = None) -> list[str]:
        return [_tool("java"), f"-Xmx{heap_mb or self.heap_mb}m", "-Xms64m", "-XX:+ExitOnOutOfMemoryError",
                f"-Dlog4j2.configurationFile={HERE / 'log4j2.properties'}", "-cp", str(self.libs_dir / "*")]

    def _java(self, main: str, *args: str, logs_dir: Path | None = None) -> list[str]:
        cmd = self._java_command()
        if logs_dir is not None:
            cmd.insert(-2, f"-Dkafka.logs.dir={logs_dir}")
        return [*cmd, main, *args]

    def _layout(self) -> Layout:
        recorded = self._recorded_layout()
        if recorded is None:
            layout = Layout(brokers=self.brokers, secure=self.secure, cluster_id=_new_cluster_id())
            self.home.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.layout_path, json.dumps(asdict(layout)))
            return layout
        if (recorded.brokers, recorded.secure) != (self.brokers, self.secure):
            shape = lambda b, s: f"{b}-broker {'secure' if s else 'plaintext'}"  # noqa: E731
            raise DevstackError(
                f"{self.home} holds a {shape(recorded.brokers, recorded.secure)} cluster, not a "
                f"{shape(self.brokers, self.secure)} one: stop it and remove {self.home}, or use another "
                "SLUICE_STATE_DIR")
        return recorded

    def _format(self, layout: Layout, nodes: list[tuple[NodeAddress, Path, Path]]) -> None:
        """Format every node's unformatted data directory with the one cluster id (in parallel).

        A secure cluster's storage gets one SCRAM user, ``admin`` (the brokers authenticate to each other
        as ``admin`` before any client could create users; the others are made by ``ensure_users``). The
        tool's arguments are read from a 0600 ``@argfile`` by the java launcher, so the admin password is
        not on the command line (``/proc/<pid>/cmdline`` shows only the file's name). When one node's
        format fails or takes too long, the others are killed, not left running."""
        scram = []
        if self.secure:
            scram = ["--add-scram", f"{MECHANISM}=[name={ADMIN},password={self.credentials()[ADMIN]}]"]
        running: list[tuple[Path, subprocess.Popen, Path]] = []
        argfiles: list[Path] = []
        try:
            for address, props, data_dir in nodes:
                if (data_dir / "meta.properties").exists():
                    continue
                if not layout.cluster_id:
                    raise DevstackError(f"{data_dir} is not formatted and {self.layout_path} has no cluster id")
                # --cluster-id=…: ids may start with "-"
                args = ["kafka.tools.StorageTool", "format", f"--cluster-id={layout.cluster_id}",
                        "-c", str(props), *scram]
                argfile = props.parent / "format.args"
                _write_atomic(argfile, "\n".join(_argfile_quote(a) for a in args) + "\n", mode=0o600)
                argfiles.append(argfile)
                log_path = props.parent / "format.log"
                with open(log_path, "w") as log:
                    proc = subprocess.Popen([*self._java_command(), f"@{argfile}"], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                running.append((data_dir, proc, log_path))
            deadline = time.monotonic() + FORMAT_TIMEOUT_S
            pending = list(running)
            while pending:
                for data_dir, proc, log_path in pending:
                    if proc.poll() not in (None, 0):
                        raise DevstackError(f"formatting {data_dir} failed:\n{_tail(str(log_path), 40)}")
                pending = [entry for entry in pending if entry[1].poll() is None]
                if pending and time.monotonic() > deadline:
                    raise DevstackError(f"formatting {[str(d) for d, _, _ in pending]} took longer than "
                                        f"{FORMAT_TIMEOUT_S:.0f}s")
                if pending:
                    time.sleep(0.1)
        finally:
            for _, proc, _ in running:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            for argfile in argfiles:
                argfile.unlink(missing_ok=True)

    def _launch(self, node_id: int, props: Path, log_path: Path) -> int:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(self._java("kafka.Kafka", str(props), logs_dir=props.parent), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return proc.pid

    def start(self, timeout_s: float = 120.0) -> tuple[ClusterInfo, bool]:
        """Start (or find running) the cluster; returns its info and whether jars were downloaded."""
        downloaded = self.fetch()
        layout = self._layout()  # refuses another shape before anything is stopped or started
        current = self.info()
        if current and self.status() == "running":
            if self.secure:
                self.ensure_users(current)  # principals added since it was started
            return current, downloaded
        if current:
            self._terminate_all(current)
        security = self._security()
        ports = _free_ports(2 * self.brokers)
        addresses = [NodeAddress(i + 1, ports[2 * i], ports[2 * i + 1]) for i in range(self.brokers)]
        planned = []
        for address in addresses:
            node_dir = self._node_dir(address.node_id)
            data_dir = node_dir / "data"
            node_dir.mkdir(parents=True, exist_ok=True)
            props = node_dir / "server.properties"
            fd = os.open(props, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # secure: holds the admin password
            with os.fdopen(fd, "w") as fh:
                fh.write(render(address, addresses, data_dir, security))
            planned.append((address, props, data_dir))
        self._format(layout, planned)
        nodes: list[NodeInfo] = []
        started_at = time.time()

        def recorded() -> ClusterInfo:
            return ClusterInfo(bootstrap=",".join(f"127.0.0.1:{n.port}" for n in nodes), version=self.version,
                               secure=self.secure, started_at=started_at, nodes=tuple(nodes),
                               ca_file=str(security.tls.ca) if security else "")

        try:
            for address, props, data_dir in planned:
                log_path = props.parent / "broker.log"
                nodes.append(NodeInfo(node_id=address.node_id, pid=self._launch(address.node_id, props, log_path),
                                      port=address.port, controller_port=address.controller_port,
                                      properties=str(props), data_dir=str(data_dir), log_path=str(log_path)))
                self._record(recorded())  # each node as it starts: `stop` finds whatever is running
            info = recorded()
            self._wait_registered(info, {n.node_id for n in nodes}, timeout_s)
            if self.secure:
                self.ensure_users(info)
        except BaseException:
            if nodes:
                self._terminate_all(recorded(), just_launched=True)
            raise
        return info, downloaded

    def _record(self, info: ClusterInfo) -> None:
        _write_atomic(self.info_path, info.to_json())

    def _wait_registered(self, info: ClusterInfo, node_ids: set[int], timeout_s: float) -> None:
        """Until each node in ``node_ids`` answers on its own listener with metadata listing all of them
        (asking another node is not enough: a node killed a moment ago is listed until it is fenced);
        fails early when one of them exits."""
        deadline = time.monotonic() + timeout_s
        options = self.client_options()
        waiting = [node for node in info.nodes if node.node_id in node_ids]
        while time.monotonic() < deadline:
            for node in waiting:
                if _exited(node.pid):
                    _reap(node.pid)
                    raise DevstackError(f"node {node.node_id} exited; see {node.log_path}:\n{_tail(node.log_path)}")
            waiting = [node for node in waiting
                       if not node_ids <= (asyncio.run(_metadata_brokers(f"127.0.0.1:{node.port}", 2.0, options))
                                           or set())]
            if not waiting:
                return
            time.sleep(0.3)
        raise DevstackError(f"nodes {[n.node_id for n in waiting]} did not register within {timeout_s:.0f}s; "
                            f"see the broker.log files under {self.home}")

    def stop(self) -> bool:
        """Stop every recorded node; False when none was recorded."""
        info = self.info()
        if info is None:
            return False
        self._terminate_all(info)
        return True

    def _terminate_all(self, info: ClusterInfo, just_launched: bool = False) -> None:
        """Stop every node. ``just_launched``: our own children of this start, which may not have exec'd java
        yet (an empty command line), so they are told by their pid alone."""
        running = (lambda n: not _exited(n.pid)) if just_launched else self._alive
        for node in info.nodes:
            _signal(node, signal.SIGTERM, running(node))
        for node in info.nodes:
            self._wait_gone(node, 30.0, running)
        self.info_path.unlink(missing_ok=True)

    def _wait_gone(self, node: NodeInfo, timeout_s: float, running=None) -> None:
        running = running or self._alive
        deadline = time.monotonic() + timeout_s
        while running(node) and time.monotonic() < deadline:
            _reap(node.pid)
            time.sleep(0.1)
        if running(node):
            _signal(node, signal.SIGKILL, True)
            while running(node):
                _reap(node.pid)
                time.sleep(0.05)
        _reap(node.pid)  # a killed child of ours is a zombie (no command line) until collected

    # -- failure drills -----------------------------------------------------------------------------

    def kill(self, node_id: int) -> None:
        """``kill -9`` one node (no shutdown, no leadership hand-over) and wait until it is gone."""
        info = self._running_info()
        node = info.node(node_id)
        if not self._alive(node):
            raise DevstackError(f"node {node_id} is not running")
        _signal(node, signal.SIGKILL, True)
        self._wait_gone(node, 30.0)

    def restart(self, node_id: int, timeout_s: float = 120.0) -> NodeInfo:
        """Start a stopped node again with its ports, data and configuration; returns once it is registered."""
        info = self._running_info()
        node = info.node(node_id)
        if self._alive(node):
            raise DevstackError(f"node {node_id} is still running")
        restarted = NodeInfo(**{**asdict(node), "pid": self._launch(node_id, Path(node.properties),
                                                                     Path(node.log_path))})
        info = ClusterInfo(**{**asdict(info), "nodes": tuple(restarted if n.node_id == node_id else n
                                                             for n in info.nodes)})
        self._record(info)
        self._wait_registered(info, {node_id}, timeout_s)
        return restarted

    def lagging_partitions(self) -> list[str]:
        """Partitions without a leader or with a replica out of the in-sync set (empty: all in sync)."""
        return asyncio.run(replication.lagging_partitions(self._reachable(), self.client_options()))

    def wait_in_sync(self, timeout_s: float) -> None:
        """Until every partition of every topic has a leader and all its replicas in sync."""
        deadline = time.monotonic() + timeout_s
        lagging: list[str] = []
        while time.monotonic() < deadline:
            try:
                lagging = self.lagging_partitions()
            except Exception as exc:  # a node may be mid-start: ask again
                lagging = [f"metadata: {type(exc).__name__}: {exc}"]
            if not lagging:
                return
            time.sleep(0.5)
        raise DevstackError(f"not in sync after {timeout_s:.0f}s: {lagging[:10]}")

    def leader_counts(self) -> dict[int, int]:
        """node id → partitions it leads."""
        return asyncio.run(replication.leaders(self._reachable(), self.client_options()))

    def _reachable(self) -> str:
        """The bootstrap list without nodes that are down (aiokafka would log each failed connection)."""
        bootstrap = self._running_info().bootstrap
        return _listening(bootstrap) or bootstrap

    def _running_info(self) -> ClusterInfo:
        info = self.info()
        if info is None:
            raise DevstackError("no devstack cluster is recorded; start it first")
        return info


def _signal(node: NodeInfo, sig: int, alive: bool) -> None:
    if not alive:
        return
    try:
        os.killpg(node.pid, sig)
    except ProcessLookupError:
        pass


def _exited(pid: int) -> bool:
    """Gone or a zombie. (Not ``_alive``: just after ``Popen`` returns, the child may not have exec'd java
    yet, and its command line is still empty.)"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _reap(pid: int) -> None:
    """Collect our own child's exit status so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _tail(path: str, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def bootstrap_servers(settings: Settings) -> str:
    """The broker to use: the configured one, else the devstack's recorded one."""
    try:
        return broker.bootstrap_servers(settings)
    except broker.NoBroker as exc:
        raise DevstackError(str(exc)) from None
