# tally in a small image: build with the Rust toolchain, run on Debian slim.
#
#   docker build -t tally .
#   docker run --rm tally run --help

FROM rust:1-bookworm AS build
# librdkafka is compiled from source with TLS and SCRAM, against the system's OpenSSL.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libssl-dev pkg-config \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY benches benches
COPY src src
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin tally \
    && cp target/release/tally /usr/local/bin/tally

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libssl3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home tally
COPY --from=build /usr/local/bin/tally /usr/local/bin/tally
USER 10001
# /metrics, /healthz and /readyz, once --metrics-addr (TALLY_METRICS_ADDR) is 0.0.0.0:9464.
EXPOSE 9464
ENTRYPOINT ["tally"]
CMD ["run"]
