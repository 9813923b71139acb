# tally in a small image: build with the Rust toolchain, run on Debian slim.
#
#   docker build -t tally .
#   docker run --rm tally run --help
#
# The image ships the service's binary, `tally`, alone. The lab's traffic generator
# (`tally-lab produce`, which docker-compose.yml runs) has an image of its own, the `lab` target:
#
#   docker build --target lab -t tally-lab .
#
# A release image carries the version and the commit it was built from, in its labels and in
# `tally --version`. The version is Cargo.toml's: VERSION below repeats it (tests/deploy_assets.rs
# fails when they differ, and the build fails when the binary says otherwise). The commit is
# passed in, since .git stays out of the build context:
#
#   docker build --build-arg REVISION="$(git rev-parse --short HEAD)" \
#     -t tally:"$(cargo pkgid | sed 's/.*[#@]//')" .
#
# Works with the classic builder as with BuildKit: dependencies are compiled in a layer of their
# own, from Cargo.toml and Cargo.lock alone, so a change under src/ rebuilds only tally.
#
# Base images are pinned to a Rust release and a Debian point release of the same Debian
# (bookworm: the binary links the builder's OpenSSL 3 and glibc); bump them together. For
# reproducible builds, pin by digest in the registry you pull from.
#
# No HEALTHCHECK: the one image runs `tally run`, `tally serve` and the admin commands, and only
# `tally run` serves /healthz and /readyz (on --metrics-addr); a check in the image would mark
# every other container unhealthy. Whatever runs `tally run` probes it:
# docker-compose.yml asks /readyz, deploy/k8s/deployment.yaml has liveness on /healthz and
# readiness on /readyz.

FROM rust:1.95.0-bookworm AS build
# librdkafka is compiled from source with TLS and SCRAM, against the system's OpenSSL.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libssl-dev pkg-config \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Dependencies first, against placeholder sources: this layer is rebuilt only when the
# manifests, the lock file, build.rs or the proto change. The lab is a member of the workspace,
# so its manifest is needed to read the workspace, and its placeholder sources to load it.
# tally-fetch (fetch/), the service's one crate of FFI, is a dependency like any other.
COPY Cargo.toml Cargo.lock build.rs ./
COPY lab/Cargo.toml lab/Cargo.toml
COPY fetch fetch
COPY proto proto
RUN mkdir -p src/bin/tally lab/src lab/benches \
    && touch src/lib.rs lab/src/lib.rs \
    && echo 'fn main() {}' > src/bin/tally/main.rs \
    && echo 'fn main() {}' > lab/src/main.rs \
    && echo 'fn main() {}' > lab/benches/pipeline.rs \
    && cargo build --profile dist --locked -p tally --bin tally \
    && rm -rf src
COPY src src
# Declared here, not above, so that a new revision leaves the dependency layer cached.
ARG VERSION=0.1.0
ARG REVISION=unknown
# COPY keeps the files' own times, which may be older than the placeholders' build: touch the
# crate roots so cargo rebuilds tally itself. The `dist` profile (Cargo.toml) is the release
# build without debug info: the release profile keeps line tables for the benchmarks'
# profiles, which an image has no use for. The binary must report the VERSION the labels carry.
RUN touch src/lib.rs src/bin/tally/main.rs \
    && TALLY_GIT_REVISION="$REVISION" cargo build --profile dist --locked -p tally --bin tally \
    && cp target/dist/tally /usr/local/bin/tally \
    && reported="$(/usr/local/bin/tally --version)" \
    && if [ "$reported" != "tally $VERSION ($REVISION)" ]; then \
         echo "the binary reports '$reported', not tally $VERSION ($REVISION): set VERSION to Cargo.toml's version" >&2; \
         exit 1; \
       fi

# The lab's binary, for the `lab` image below: built from the same layers, the service's sources
# included (the lab links the tally library), plus its own.
FROM build AS lab-build
COPY lab lab
COPY scripts/kafka/pom.xml scripts/kafka/pom.xml
RUN touch lab/src/lib.rs lab/src/main.rs \
    && cargo build --profile dist --locked -p tally-lab --bin tally-lab \
    && cp target/dist/tally-lab /usr/local/bin/tally-lab

# The traffic generator of docker-compose.yml: `tally-lab produce`. Not a release image: the
# service's image, the last stage, is.
FROM debian:12.12-slim AS lab
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libssl3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home tally
COPY --from=lab-build /usr/local/bin/tally-lab /usr/local/bin/tally-lab
USER 10001
ENTRYPOINT ["tally-lab"]
CMD ["produce"]

# The service's image, the default target.
FROM debian:12.12-slim
ARG VERSION=0.1.0
ARG REVISION=unknown
# Where the source lives; an organisation's build sets its own.
ARG SOURCE=https://tally.example.com/tally
LABEL org.opencontainers.image.title="tally" \
      org.opencontainers.image.description="Counts likes from Kafka into Redis exactly once." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/debian:12.12-slim"
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libssl3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home tally
COPY --from=build /usr/local/bin/tally /usr/local/bin/tally
USER 10001
# /metrics, /healthz and /readyz of `tally run`, once --metrics-addr (TALLY_METRICS_ADDR) is
# 0.0.0.0:9464.
EXPOSE 9464
ENTRYPOINT ["tally"]
CMD ["run"]
