"""A real Apache Kafka broker on 127.0.0.1, fetched from Maven Central.

The broker's jars are resolved once with the machine's ``mvn`` into
``<cache_dir>/kafka/<version>/libs`` and reused; only the small ``pom.xml``
beside this file lives in the project. The broker runs as one combined KRaft
node (broker + controller) in its own session, so it outlives the CLI that
started it, and its address is recorded in ``<state_dir>/kafka/broker.json``
where the CLI, the worker and the tests find it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import broker
from ..settings import Settings

HERE = Path(__file__).resolve().parent
COMPLETE_MARKER = ".complete"


class DevstackError(RuntimeError):
    """The local broker could not be fetched, started or reached."""


@dataclass(frozen=True)
class BrokerInfo:
    pid: int
    bootstrap: str
    controller_port: int
    version: str
    data_dir: str
    log_path: str
    started_at: float


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tool(name: str) -> str:
    if name == "java" and os.environ.get("JAVA_HOME"):
        candidate = Path(os.environ["JAVA_HOME"]) / "bin" / "java"
        if candidate.exists():
            return str(candidate)
    path = shutil.which(name)
    if not path:
        raise DevstackError(f"`{name}` is not on PATH; the Kafka devstack needs Java 17+ and Maven")
    return path


def _port_open(bootstrap: str) -> bool:
    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
        return True
    except OSError:
        return False


async def _answers_metadata(bootstrap: str, timeout_s: float) -> bool:
    from aiokafka import AIOKafkaClient

    if not _port_open(bootstrap):
        return False

    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout_s)
        return True
    except Exception:
        return False
    finally:
        await client.close()


def answers_metadata(bootstrap: str, timeout_s: float = 2.0) -> bool:
    """True when a broker at ``bootstrap`` answers a metadata request."""
    return asyncio.run(_answers_metadata(bootstrap, timeout_s))


class KafkaDevstack:
    def __init__(self, settings: Settings) -> None:
        self.version = settings.kafka_version
        self.heap_mb = settings.kafka_heap_mb
        self.libs_dir = settings.cache_dir / "kafka" / self.version / "libs"
        self.home = settings.kafka_dir
        self.data_dir = self.home / "data"
        self.info_path = broker.address_file(settings)
        self.log_path = self.home / "broker.log"

    def fetched(self) -> bool:
        return (self.libs_dir / COMPLETE_MARKER).exists()

    def fetch(self) -> bool:
        """Resolve the broker's jars into the cache; False when they were already there."""
        if self.fetched():
            return False
        staging = self.libs_dir.with_name("libs.partial")
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
        shutil.rmtree(self.libs_dir, ignore_errors=True)
        staging.rename(self.libs_dir)
        return True

    def info(self) -> BrokerInfo | None:
        try:
            return BrokerInfo(**json.loads(self.info_path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _alive(self, info: BrokerInfo) -> bool:
        try:
            cmdline = Path(f"/proc/{info.pid}/cmdline").read_bytes()
        except OSError:
            return False
        return b"kafka.Kafka" in cmdline and str(self.home).encode() in cmdline

    def status(self) -> str:
        """``running`` (process alive and answering), ``dead`` (recorded but gone
        or mute) or ``stopped`` (nothing recorded)."""
        info = self.info()
        if info is None:
            return "stopped"
        if self._alive(info) and answers_metadata(info.bootstrap):
            return "running"
        return "dead"

    def _java(self, main: str, *args: str) -> list[str]:
        return [_tool("java"), f"-Xmx{self.heap_mb}m", "-Xms128m", "-XX:+ExitOnOutOfMemoryError",
                f"-Dlog4j2.configurationFile={HERE / 'log4j2.properties'}",
                f"-Dkafka.logs.dir={self.home}", "-cp", str(self.libs_dir / "*"), main, *args]

    def _write_properties(self, port: int, controller_port: int) -> Path:
        props = self.home / "server.properties"
        props.write_text("\n".join([
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{controller_port}",
            f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{port}",
            "controller.listener.names=CONTROLLER",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name=PLAINTEXT",
            f"log.dirs={self.data_dir}",
            "num.partitions=1",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=8",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            "group.initial.rebalance.delay.ms=0",
            "auto.create.topics.enable=true",
            "log.segment.bytes=67108864",
            "log.cleaner.dedupe.buffer.size=33554432",
            "",
        ]))
        return props

    def _format(self, props: Path) -> None:
        if (self.data_dir / "meta.properties").exists():
            return
        cluster_id = subprocess.run(self._java("kafka.tools.StorageTool", "random-uuid"),
                                    capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        proc = subprocess.run(self._java("kafka.tools.StorageTool", "format", "-t", cluster_id,
                                         "-c", str(props)), capture_output=True, text=True)
        if proc.returncode != 0:
            raise DevstackError(f"formatting {self.data_dir} failed:\n{proc.stdout}{proc.stderr}")

    def start(self, timeout_s: float = 90.0) -> tuple[BrokerInfo, bool]:
        """Start (or find running) the broker; returns its info and whether jars were downloaded."""
        downloaded = self.fetch()
        current = self.info()
        if current and self.status() == "running":
            return current, downloaded
        if current:
            self._terminate(current)
        self.home.mkdir(parents=True, exist_ok=True)
        port, controller_port = _free_port(), _free_port()
        while controller_port == port:
            controller_port = _free_port()
        props = self._write_properties(port, controller_port)
        self._format(props)
        log = open(self.log_path, "ab")
        proc = subprocess.Popen(self._java("kafka.Kafka", str(props)), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        info = BrokerInfo(pid=proc.pid, bootstrap=f"127.0.0.1:{port}", controller_port=controller_port,
                          version=self.version, data_dir=str(self.data_dir), log_path=str(self.log_path),
                          started_at=time.time())
        self.info_path.write_text(json.dumps(asdict(info)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise DevstackError(f"broker exited with {proc.returncode}; see {self.log_path}:\n{self._log_tail()}")
            if answers_metadata(info.bootstrap, 1.0):
                return info, downloaded
            time.sleep(0.2)
        self._terminate(info)
        raise DevstackError(f"broker did not answer metadata within {timeout_s:.0f}s; see {self.log_path}")

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _terminate(self, info: BrokerInfo, timeout_s: float = 30.0) -> None:
        if self._alive(info):
            try:
                os.killpg(info.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout_s
            while self._alive(info) and time.monotonic() < deadline:
                _reap(info.pid)
                time.sleep(0.1)
            if self._alive(info):
                os.killpg(info.pid, signal.SIGKILL)
                while self._alive(info):
                    _reap(info.pid)
                    time.sleep(0.05)
        self.info_path.unlink(missing_ok=True)

    def stop(self) -> bool:
        """Stop the recorded broker; False when none was recorded."""
        info = self.info()
        if info is None:
            return False
        self._terminate(info)
        return True


def _reap(pid: int) -> None:
    """Collect our own child's exit status so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def bootstrap_servers(settings: Settings) -> str:
    """The broker to use: the configured one, else the devstack's recorded one."""
    try:
        return broker.bootstrap_servers(settings)
    except broker.NoBroker as exc:
        raise DevstackError(str(exc)) from None
