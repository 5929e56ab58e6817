# A Sluice worker (`sluice worker --role control|landing|all`) on Debian bookworm's Python 3.11.
# Context: the repository root (/.dockerignore keeps it to the project's sources):
#   docker build -f deploy/docker/worker.Dockerfile -t sluice/worker .
# deploy/docker/build_images.py builds it FROM the local base image and, so
# that nothing is downloaded from PyPI inside the build, with WHEELS=<url of a
# wheelhouse served on 127.0.0.1> (--network=host); without WHEELS pip uses
# the index as usual.
#
# Every instruction that only sets metadata comes first: with the vfs storage
# driver each step copies the whole file system, which is small before the RUN.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
ARG WHEELS=
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    SLUICE_STATE_DIR=/var/lib/sluice \
    SLUICE_CACHE_DIR=/var/lib/sluice/cache \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /var/lib/sluice
EXPOSE 6066
# runs as the unprivileged user `sluice` (created below)
ENTRYPOINT ["/usr/bin/setpriv", "--reuid=sluice", "--regid=sluice", "--init-groups", "--", "/opt/venv/bin/sluice"]
CMD ["worker"]
COPY . /opt/sluice/
# One layer: the interpreter, the dependencies, the project (editable: it finds sql/ and schemas/
# beside its package), the user.
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /usr/share/doc/* /usr/share/man/* \
 && python3 -m venv /opt/venv \
 && pip="/opt/venv/bin/pip install -q --no-cache-dir --disable-pip-version-check ${WHEELS:+--no-index --find-links $WHEELS}" \
 && $pip 'setuptools>=77' wheel \
 && $pip --no-build-isolation -e /opt/sluice \
 && find /opt/venv /opt/sluice -name __pycache__ -prune -exec rm -rf {} + \
 && useradd --system --home-dir /var/lib/sluice sluice \
 && mkdir -p /var/lib/sluice/cache && chown -R sluice:sluice /var/lib/sluice
