# Shell helpers shared by the project's scripts: install what is missing. Source it; it defines
# functions only.

# Prints a progress line on stderr.
say() {
    printf '[%s] %s\n' "$(basename "$0")" "$*" >&2
}

# Runs a command as root (directly, or through sudo when this user is not root).
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    else
        sudo "$@"
    fi
}

# Installs Debian's redis-server when it is not on PATH.
ensure_redis() {
    if command -v redis-server >/dev/null 2>&1; then
        return
    fi
    say "redis-server not found: installing it with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    # The package starts a system-wide instance on 6379; the tests use private ones only.
    if command -v systemctl >/dev/null 2>&1; then
        as_root systemctl disable --now redis-server >/dev/null 2>&1 || true
    fi
    say "installed $(redis-server --version)"
}

# Installs Debian's wrk, the HTTP load generator `tally bench-reads` measures `tally serve` with.
ensure_wrk() {
    if command -v wrk >/dev/null 2>&1; then
        return
    fi
    say "wrk not found: installing it with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null
    say "installed $(wrk --version 2>&1 | head -n 1)"
}

# Installs what building tally needs beyond Rust: librdkafka is compiled with TLS and SCRAM
# support (rdkafka's `ssl` feature), which links the system's OpenSSL, found with pkg-config.
ensure_build_deps() {
    local missing=()
    command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
    if ! pkg-config --exists openssl 2>/dev/null; then
        missing+=(libssl-dev)
    fi
    if [ "${#missing[@]}" -eq 0 ]; then
        return
    fi
    say "building librdkafka with TLS needs ${missing[*]}: installing with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

# Installs what the TLS tests need: openssl makes their private CA and certificates, and socat
# terminates TLS in front of the Tansu broker (tests/e2e_kafka_security.rs; Tansu 0.6.0 serves no
# TLS of its own).
ensure_tls_tools() {
    local missing=()
    command -v openssl >/dev/null 2>&1 || missing+=(openssl)
    command -v socat >/dev/null 2>&1 || missing+=(socat)
    if [ "${#missing[@]}" -eq 0 ]; then
        return
    fi
    say "the TLS tests need ${missing[*]}: installing with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

# Installs Debian's docker-compose (the deploy test checks docker-compose.yml with
# `docker-compose config`; no container engine is needed for that).
ensure_compose() {
    if command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1; then
        return
    fi
    say "docker-compose not found: installing Debian's docker-compose with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null
}

# Installs Debian's prometheus package for promtool (the deploy test runs `promtool check rules`
# and `promtool test rules` on deploy/prometheus/). Only promtool is used: the server the package
# would start on a systemd host is stopped and disabled.
ensure_promtool() {
    if command -v promtool >/dev/null 2>&1; then
        return
    fi
    say "promtool not found: installing Debian's prometheus with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        prometheus >/dev/null
    if command -v systemctl >/dev/null 2>&1; then
        as_root systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
    say "installed $(promtool --version 2>&1 | head -n 1)"
}

# pip-installs PACKAGE==VERSION, bringing python3 and pip from Debian first when they are
# missing. A Debian python3 refuses pip installs outside a virtualenv unless told (PEP 668).
pip_install() {
    if ! python3 -m pip --version >/dev/null 2>&1; then
        say "python3 with pip not found: installing Debian's python3-pip with apt-get"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-pip \
            >/dev/null
    fi
    say "$1 not found: python3 -m pip install $1"
    python3 -m pip install --quiet "$1" 2>/dev/null ||
        python3 -m pip install --quiet --break-system-packages "$1"
    hash -r
}

# Installs the Python Kafka client for tests/producers/produce.py, the producer other than tally
# that tests/e2e_codecs.rs runs: confluent-kafka, whose wheels bundle a librdkafka built with
# gzip, snappy, lz4 and zstd.
ensure_python_kafka() {
    if python3 -c 'import confluent_kafka' >/dev/null 2>&1; then
        return
    fi
    pip_install confluent-kafka==2.16.1
    say "installed confluent-kafka $(python3 -c 'import confluent_kafka; print(confluent_kafka.__version__)')"
}

# Installs schemathesis from PyPI (tests/serve_api.rs fuzzes `tally serve` against
# docs/openapi.yaml with it).
ensure_schemathesis() {
    if command -v schemathesis >/dev/null 2>&1; then
        return
    fi
    pip_install schemathesis==4.32.5
    say "installed $(schemathesis --version)"
}

# Installs buf from npm (tests/proto_contract.rs runs `buf lint` and `buf breaking` on proto/,
# configured by buf.yaml). Brings Debian's npm first when it is missing.
ensure_buf() {
    if command -v buf >/dev/null 2>&1; then
        return
    fi
    if ! command -v npm >/dev/null 2>&1; then
        say "npm not found: installing Debian's npm with apt-get"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
    fi
    say "buf not found: npm install -g @bufbuild/buf@1.75.0"
    as_root npm install -g --silent @bufbuild/buf@1.75.0
    say "installed buf $(buf --version)"
}

# Path of the tansu binary, or nothing.
tansu_path() {
    if [ -x "$HOME/.cargo/bin/tansu" ]; then
        echo "$HOME/.cargo/bin/tansu"
    else
        command -v tansu 2>/dev/null || true
    fi
}

# Installs the Tansu broker (a Kafka-compatible broker written in Rust) with cargo when missing.
ensure_tansu() {
    if [ -n "$(tansu_path)" ]; then
        return
    fi
    # One build serves both: memory storage for the tests, SQLite storage for the SCRAM logins of
    # tests/e2e_kafka_security.rs (see ensure_tansu_libsql).
    say "tansu not found: cargo install tansu --version 0.6.0 --features dynostore,libsql --locked"
    say "(about 25-35 minutes on a 2-core machine the first time)"
    cargo install tansu --version 0.6.0 --features dynostore,libsql --locked
}

# A Tansu with SQLite storage (the `libsql` feature) at ~/.cargo/tansu-libsql/bin/tansu: the
# memory storage keeps no SCRAM credentials, so a SCRAM login can only succeed against this one
# (tests/e2e_kafka_security.rs). ensure_tansu builds the feature in, and this links to that
# build; only a Tansu installed without it (an older ensure_tansu) needs a second build.
ensure_tansu_libsql() {
    local linked="$HOME/.cargo/tansu-libsql/bin/tansu"
    if [ -x "$linked" ]; then
        return
    fi
    local crates="$HOME/.cargo/.crates2.json"
    if [ -f "$crates" ] && grep -o '"tansu 0.6.0[^}]*}' "$crates" | grep -q '"libsql"'; then
        mkdir -p "$(dirname "$linked")"
        ln -sf "$(tansu_path)" "$linked"
        return
    fi
    say "tansu with SQLite storage not found: cargo install tansu --version 0.6.0 --features libsql --locked --root ~/.cargo/tansu-libsql"
    cargo install tansu --version 0.6.0 --features libsql --locked --root "$HOME/.cargo/tansu-libsql"
}

