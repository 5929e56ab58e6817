"""Build Sluice's container images locally, each only when missing.

    .venv/bin/python deploy/docker/build_images.py [all|base|kafka|worker|prometheus] [--env]

No image registry is needed: the base image is a Debian bookworm ``minbase``
made by ``debootstrap`` from the machine's configured Debian mirror and
imported as ``sluice/debian-base:bookworm``; the others are ``FROM`` it and
install Debian packages (``docker build --network=host``):

* ``sluice/kafka:<kafka_version>-<hash>``: ``kafka.Dockerfile``, the devstack's
  Maven jars (``~/.cache/sluice/kafka/<version>/libs``, fetched with ``mvn`` when
  missing) and an entrypoint that writes a KRaft ``server.properties`` from
  ``KAFKA_*`` variables;
* ``sluice/worker:<version>-<hash>``: ``worker.Dockerfile`` with the project,
  its dependencies installed from a wheelhouse built on the host
  (``pip wheel``) and served on 127.0.0.1 during the build;
* ``sluice/prometheus:bookworm-<hash>``: Debian's Prometheus.

``<hash>`` covers the Dockerfile and everything copied into the image (for
the worker: the project's sources), so a change rebuilds and an unchanged
tree reuses the image. Each build also tags ``<name>:<version>`` (no hash),
which ``deploy/compose/local.yml`` uses by default. ``--env`` prints the
hashed tags as ``SLUICE_*_IMAGE=`` lines for ``docker-compose``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BASE_IMAGE = "sluice/debian-base:bookworm"
SUITE = "bookworm"
FALLBACK_MIRROR = "http://deb.debian.org/debian"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
WORKER_SOURCES = ("pyproject.toml", "README.md", "pipeline", "sql", "schemas")

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class BuildError(RuntimeError):
    """An image could not be built."""


def log(message: str) -> None:
    print(f"build_images: {message}", file=sys.stderr, flush=True)


def docker(*args: str, check: bool = True, capture: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], text=True, capture_output=capture, **kw)
    if check and proc.returncode != 0:
        out = (proc.stdout or "")[-4000:] + (proc.stderr or "")[-4000:] if capture else ""
        raise BuildError(f"docker {' '.join(args[:3])} … failed ({proc.returncode}):\n{out}")
    return proc


def engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, check=False).returncode == 0


def _lock_path() -> Path:
    path = Path(os.path.expanduser("~/.cache/sluice"))
    path.mkdir(parents=True, exist_ok=True)
    return path / "images.lock"


_held = threading.local()


@contextlib.contextmanager
def build_lock():
    """One build at a time on this machine (a parallel session waits, then finds the image); reentrant."""
    if getattr(_held, "depth", 0):
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    with open(_lock_path(), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        _held.depth = 1
        try:
            yield
        finally:
            _held.depth = 0
            fcntl.flock(fh, fcntl.LOCK_UN)


def _hash_paths(paths: list[Path], extra: str = "") -> str:
    digest = hashlib.sha256(extra.encode())
    for path in paths:
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            digest.update(str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name).encode())
            digest.update(b"\0")
            digest.update(f.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()[:12]


def debian_mirror() -> str:
    """The machine's configured Debian mirror (deb822 ``.sources`` or one-line ``sources.list``)."""
    candidates = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*.sources")),
                  *sorted(Path("/etc/apt/sources.list.d").glob("*.list"))]
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for match in re.finditer(r"^(?:deb\s+(?:\[[^\]]*\]\s+)?(\S+)|URIs:\s*(\S+))", text, re.M):
            uri = match.group(1) or match.group(2)
            if "security" not in uri and re.search(r"/debian/?$", uri):
                return uri.rstrip("/")
    return FALLBACK_MIRROR


def _timed(name: str):
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kw):
            started = time.monotonic()
            result = fn(*args, **kw)
            if result is not None and result[1]:
                log(f"built {result[0]} in {time.monotonic() - started:.0f}s")
            return result
        return run
    return wrap


@_timed("base")
def ensure_base() -> tuple[str, bool]:
    """``sluice/debian-base:bookworm`` from debootstrap; (tag, built)."""
    if image_exists(BASE_IMAGE):
        return BASE_IMAGE, False
    with build_lock():
        if image_exists(BASE_IMAGE):
            return BASE_IMAGE, False
        return _debootstrap_base()


def _debootstrap_base() -> tuple[str, bool]:
    debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    if not Path(debootstrap).exists():
        raise BuildError("debootstrap is missing: apt-get install -y debootstrap (or run deploy/prerequisites.sh)")
    mirror = debian_mirror()
    with tempfile.TemporaryDirectory(prefix="sluice-rootfs-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        log(f"debootstrap --variant=minbase {SUITE} from {mirror} (about a minute)")
        proc = subprocess.run([debootstrap, "--variant=minbase", SUITE, str(rootfs), mirror],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"debootstrap failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        # a smaller image: no apt lists, caches or docs
        for junk in ("var/lib/apt/lists", "var/cache/apt/archives"):
            for child in (rootfs / junk).glob("*"):
                if child.is_file() and child.name != "lock":
                    child.unlink()
        for junk in ("usr/share/doc", "usr/share/man", "usr/share/info"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
            (rootfs / junk).mkdir(parents=True, exist_ok=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["docker", "import", "-c", "ENV LANG=C.UTF-8", "-c", f"ENV PATH={DEFAULT_PATH}",
                                   "-", BASE_IMAGE],
                                  stdin=tar.stdout, capture_output=True, text=True)
        tar.stdout.close()
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise BuildError(f"docker import failed:\n{imported.stderr}")
    return BASE_IMAGE, True


def _build(dockerfile: Path, tag: str, context: Path, *build_args: str) -> None:
    args = ["build", "--network=host", "--rm", "--force-rm", "-q", "-f", str(dockerfile), "-t", tag,
            "--build-arg", f"BASE={BASE_IMAGE}"]
    for arg in build_args:
        args += ["--build-arg", arg]
    # the classic builder: works with Debian's docker.io client and with newer clients without buildx
    docker(*args, str(context), env={**os.environ, "DOCKER_BUILDKIT": "0"})


def _settings():
    from pipeline.settings import load_settings

    return load_settings()


@_timed("kafka")
def ensure_kafka(version: str | None = None) -> tuple[str, bool]:
    """``sluice/kafka:<version>-<hash>``; (tag, built)."""
    from pipeline.devstack.kafka import KafkaDevstack

    settings = _settings()
    if version:
        from dataclasses import replace
        settings = replace(settings, kafka_version=version)
    devstack = KafkaDevstack(settings)
    devstack.fetch()
    files = [HERE / "kafka.Dockerfile", HERE / "kafka-entrypoint.sh", HERE / "kafka-log4j2.properties"]
    jars = sorted(p.name for p in devstack.libs_dir.glob("*.jar"))
    tag = f"sluice/kafka:{devstack.version}-{_hash_paths(files, BASE_IMAGE + ' '.join(jars))}"
    if image_exists(tag):
        return tag, False
    with build_lock():
        return _build_kafka(tag, devstack, files, jars)


def _build_kafka(tag, devstack, files, jars) -> tuple[str, bool]:
    if image_exists(tag):
        return tag, False
    ensure_base()
    with tempfile.TemporaryDirectory(prefix="sluice-kafka-ctx-") as tmp:
        ctx = Path(tmp)
        for f in files:
            shutil.copy2(f, ctx / f.name)
        (ctx / "libs").mkdir()
        for jar in jars:
            src = devstack.libs_dir / jar
            try:
                os.link(src, ctx / "libs" / jar)
            except OSError:
                shutil.copy2(src, ctx / "libs" / jar)
        _build(ctx / "kafka.Dockerfile", tag, ctx)
    docker("tag", tag, f"sluice/kafka:{devstack.version}")
    _drop_older("sluice/kafka", tag)
    return tag, True


def _project_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def wheelhouse() -> Path:
    """Wheels of the project's dependencies (and setuptools/wheel to install it), built on the host."""
    path = Path(os.path.expanduser("~/.cache/sluice/wheels"))
    path.mkdir(parents=True, exist_ok=True)
    pip = ROOT / ".venv" / "bin" / "pip"
    pip_cmd = [str(pip)] if pip.exists() else [sys.executable, "-m", "pip"]
    started = time.monotonic()
    proc = subprocess.run([*pip_cmd, "wheel", "-q", "--disable-pip-version-check", "-w", str(path),
                           str(ROOT), "setuptools>=77", "wheel"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"pip wheel failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    for own in path.glob("sluice-*.whl"):  # the image installs the project from its sources, editable
        own.unlink()
    log(f"wheelhouse {path} ready in {time.monotonic() - started:.0f}s")
    return path


@contextlib.contextmanager
def serve(directory: Path):
    """An HTTP directory listing of ``directory`` on 127.0.0.1 (pip's --find-links reads it)."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def worker_tag() -> str:
    files = [ROOT / name for name in WORKER_SOURCES] + [HERE / "worker.Dockerfile", ROOT / ".dockerignore"]
    return f"sluice/worker:{_project_version()}-{_hash_paths(files, BASE_IMAGE)}"


@_timed("worker")
def ensure_worker() -> tuple[str, bool]:
    """``sluice/worker:<version>-<hash>``; (tag, built)."""
    tag = worker_tag()
    if image_exists(tag):
        return tag, False
    with build_lock():
        if image_exists(tag):
            return tag, False
        return _build_worker(tag)


def _build_worker(tag: str) -> tuple[str, bool]:
    ensure_base()
    wheels = wheelhouse()
    with serve(wheels) as url:
        _build(HERE / "worker.Dockerfile", tag, ROOT, f"WHEELS={url}")
    docker("tag", tag, f"sluice/worker:{_project_version()}")
    _drop_older("sluice/worker", tag)
    return tag, True


def _drop_older(repository: str, keep: str) -> None:
    """Remove this repository's other hashed tags (each worker image is about 1 GB, more on vfs)."""
    listed = docker("images", repository, "--format", "{{.Repository}}:{{.Tag}}", check=False).stdout.split()
    for tag in listed:
        if tag != keep and re.search(r"-[0-9a-f]{12}$", tag):
            docker("rmi", tag, check=False)
    docker("image", "prune", "-f", check=False)


@_timed("prometheus")
def ensure_prometheus() -> tuple[str, bool]:
    """``sluice/prometheus:bookworm-<hash>``; (tag, built)."""
    dockerfile = HERE / "prometheus.Dockerfile"
    tag = f"sluice/prometheus:{SUITE}-{_hash_paths([dockerfile], BASE_IMAGE)}"
    if image_exists(tag):
        return tag, False
    with build_lock():
        if image_exists(tag):
            return tag, False
        ensure_base()
        return _build_prometheus(tag, dockerfile)


def _build_prometheus(tag: str, dockerfile: Path) -> tuple[str, bool]:
    with tempfile.TemporaryDirectory(prefix="sluice-prom-ctx-") as tmp:
        shutil.copy2(dockerfile, Path(tmp) / dockerfile.name)
        _build(Path(tmp) / dockerfile.name, tag, Path(tmp))
    docker("tag", tag, f"sluice/prometheus:{SUITE}")
    return tag, True


BUILDERS = {"base": ensure_base, "kafka": ensure_kafka, "worker": ensure_worker, "prometheus": ensure_prometheus}
ENV_NAMES = {"kafka": "SLUICE_KAFKA_IMAGE", "worker": "SLUICE_WORKER_IMAGE", "prometheus": "SLUICE_PROMETHEUS_IMAGE"}


def ensure(*names: str) -> dict[str, str]:
    """Build what is missing among ``names`` (default: all); name → tag."""
    if not engine_answers():
        raise BuildError("no Docker engine answers (`docker info`); run deploy/prerequisites.sh as root")
    return {name: BUILDERS[name]()[0] for name in (names or tuple(BUILDERS))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="*", choices=[*BUILDERS, "all"], default=[])
    parser.add_argument("--env", action="store_true", help="print SLUICE_*_IMAGE=<tag> lines for docker-compose")
    args = parser.parse_args(argv)
    names = tuple(n for n in args.images if n != "all")
    try:
        tags = ensure(*names)
    except BuildError as exc:
        print(f"build_images: {exc}", file=sys.stderr)
        return 1
    for name, tag in tags.items():
        print(f"{ENV_NAMES[name]}={tag}" if args.env and name in ENV_NAMES else tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
