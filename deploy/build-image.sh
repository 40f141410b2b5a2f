#!/usr/bin/env bash
# Build the daemon's image from deploy/Containerfile and smoke-run it, with buildah or podman,
# where no container registry may be reachable: the Debian base is then made with debootstrap.
#
#   deploy/build-image.sh                      # the working tree -> localhost/kvcached:dev
#   deploy/build-image.sh --rev HEAD           # a commit instead (git archive): no edit in progress
#   deploy/build-image.sh --no-cache --image localhost/kvcached:0.1.0
#   deploy/build-image.sh --smoke-only         # run the smoke checks on an image built before
#
# Environment: BASE (a base image; default: docker.io/library/debian:bookworm-slim when it can be
# pulled, else localhost/debian:bookworm made here with debootstrap), ISOLATION (the build's,
# default chroot: works inside a container or a VM whose cgroups the OCI runtimes refuse),
# DEBIAN_MIRROR (default http://deb.debian.org/debian), PIP_CERT (a CA bundle the build's pip
# must trust, where a proxy re-signs TLS; default: the host pip's global.cert, if any).
#
# Needs root and, on Debian: apt-get install buildah podman debootstrap runc. Prints what it does;
# exits non-zero at the first failed step.
set -euo pipefail

IMAGE=localhost/kvcached:dev
REV=""
NO_CACHE=()
SMOKE_ONLY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --image) IMAGE=$2; shift 2 ;;
        --rev) REV=$2; shift 2 ;;
        --no-cache) NO_CACHE=(--no-cache); shift ;;
        --smoke-only) SMOKE_ONLY=1; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
ISOLATION=${ISOLATION:-chroot}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
LOCAL_BASE=localhost/debian:bookworm
WORK=$(mktemp -d /tmp/kvcached-image.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

say() { printf '\n== %s\n' "$*"; }
die() { printf 'build-image: %s\n' "$*" >&2; exit 1; }

command -v podman >/dev/null || die "podman is missing (apt-get install podman buildah debootstrap runc)"

# ---- podman run options that work here: some sandboxes refuse the default rlimits (no
# CAP_SYS_RESOURCE: podman asks for nofile=1048576) or crun's cgroup setup (a v1/v2 hybrid
# hierarchy); the first set of options that runs `true` in IMG wins.
pick_run_opts() {
    local img=$1 nofile nproc
    nofile=$(ulimit -Hn); [ "$nofile" = unlimited ] && nofile=1048576
    nproc=$(ulimit -Hu);  { [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; } && nproc=32768
    local lim="--ulimit nofile=$nofile:$nofile --ulimit nproc=$nproc:$nproc"
    local candidates=("" "$lim")
    command -v runc >/dev/null && candidates+=("--runtime runc $lim" "--runtime runc --cgroups=disabled $lim")
    local c err
    for c in "${candidates[@]}"; do
        # shellcheck disable=SC2086
        if err=$(podman run --rm --network=none $c --entrypoint /bin/true "$img" 2>&1); then
            RUN_OPTS=$c
            echo "podman run options: ${RUN_OPTS:-(none)}"
            return 0
        fi
        echo "podman run ${c:+$c }failed: $(printf '%s' "$err" | tail -n 1)"
    done
    die "no podman run options worked here (see the errors above)"
}

# ---- the base image
make_debian_base() {
    local root=$WORK/bookworm-root
    command -v debootstrap >/dev/null || die "no registry and no debootstrap (apt-get install debootstrap)"
    say "debootstrap --variant=minbase bookworm ($DEBIAN_MIRROR)"
    local t0=$SECONDS
    debootstrap --variant=minbase bookworm "$root" "$DEBIAN_MIRROR" > "$WORK/debootstrap.log" 2>&1 \
        || { tail -n 20 "$WORK/debootstrap.log"; die "debootstrap failed"; }
    echo "debootstrap: $((SECONDS - t0)) s"
    # What Debian's own slim image does (debuerreotype): no docs, man pages or locales from dpkg,
    # apt keeps no caches, and the sources the official image has (updates and security).
    cat > "$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
EOF
    cat > "$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    rm -f "$root/etc/apt/sources.list"
    cat > "$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $DEBIAN_MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${DEBIAN_MIRROR%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    # debootstrap takes bookworm as released: the point release's and the security updates on top.
    t0=$SECONDS
    { chroot "$root" apt-get -q update && DEBIAN_FRONTEND=noninteractive chroot "$root" apt-get -q -y upgrade; } \
        > "$WORK/upgrade.log" 2>&1 || { tail -n 20 "$WORK/upgrade.log"; die "apt-get upgrade in the new root failed"; }
    echo "apt-get upgrade: $(grep -c '^Setting up' "$WORK/upgrade.log" || true) packages updated, $((SECONDS - t0)) s"
    find "$root/usr/share/doc" -mindepth 2 ! -name copyright ! -type d -delete
    find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
    rm -rf "$root"/usr/share/{info,linda,locale,man,groff}/* "$root/usr/share/lintian/overrides"/* \
           "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/var/log/* \
           "$root/etc/resolv.conf" "$root/etc/hostname" "$root/var/cache/ldconfig/aux-cache"
    : > "$root/etc/machine-id" 2>/dev/null || true
    echo "root file system: $(du -sh "$root" | cut -f1)"
    say "podman import -> $LOCAL_BASE"
    tar --numeric-owner -C "$root" -c . | podman import --change 'CMD ["bash"]' - "$LOCAL_BASE" > /dev/null
    rm -rf "$root"
}

if [ "$SMOKE_ONLY" = 0 ]; then
    if [ -z "${BASE:-}" ]; then
        say "base image"
        if podman image exists docker.io/library/debian:bookworm-slim \
           || timeout 60 podman pull -q docker.io/library/debian:bookworm-slim > /dev/null 2>"$WORK/pull.err"; then
            BASE=docker.io/library/debian:bookworm-slim
        else
            echo "no registry: $(tail -n 1 "$WORK/pull.err" 2>/dev/null)"
            if podman image exists "$LOCAL_BASE"; then
                echo "using $LOCAL_BASE made before (podman rmi it to make it again)"
            else
                make_debian_base
            fi
            BASE=$LOCAL_BASE
        fi
    fi
    echo "base: $BASE"

    # ---- the build context: the working tree (.dockerignore picks what is sent), or a commit
    CONTEXT=$REPO
    if [ -n "$REV" ]; then
        CONTEXT=$WORK/context
        mkdir -p "$CONTEXT"
        git -C "$REPO" archive "$REV" | tar -x -C "$CONTEXT"
        # the recipe itself as it is in the working tree, which the commit may not have yet
        cp "$REPO/.dockerignore" "$CONTEXT/"
        cp "$REPO/deploy/Containerfile" "$CONTEXT/deploy/Containerfile"
        echo "context: git archive $REV ($(git -C "$REPO" rev-parse --short "$REV"))"
    else
        echo "context: the working tree $REPO"
    fi
    REVISION=$(git -C "$REPO" rev-parse "${REV:-HEAD}" 2>/dev/null || true)

    BUILD_ARGS=(--build-arg "BASE=$BASE"
                --build-arg "REVISION=$REVISION"
                --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)")
    # A TLS-intercepting proxy (this kind of sandbox): the build's pip trusts the host's bundle.
    CA=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
    if [ -n "$CA" ] && [ -f "$CA" ]; then
        BUILD_ARGS+=(-v "$(readlink -f "$CA"):/etc/ssl/certs/build-ca-bundle.crt:ro"
                     --build-arg PIP_CERT=/etc/ssl/certs/build-ca-bundle.crt)
        echo "pip in the build trusts $CA (PIP_CERT)"
    fi

    say "build $IMAGE (isolation $ISOLATION)"
    t0=$SECONDS
    if command -v buildah >/dev/null; then
        buildah bud --layers --isolation "$ISOLATION" "${NO_CACHE[@]}" "${BUILD_ARGS[@]}" \
            -f "$CONTEXT/deploy/Containerfile" -t "$IMAGE" "$CONTEXT"
    else
        podman build --isolation "$ISOLATION" "${NO_CACHE[@]}" "${BUILD_ARGS[@]}" \
            -f "$CONTEXT/deploy/Containerfile" -t "$IMAGE" "$CONTEXT"
    fi
    echo "build: $((SECONDS - t0)) s"
fi

# ---- smoke run
say "image"
podman image inspect "$IMAGE" --format 'size {{.Size}} bytes, created {{.Created}}' \
    | awk '{ printf "%s %.0f MB%s\n", $1, $2 / 1e6, substr($0, index($0, ",")) }'
podman image inspect "$IMAGE" --format '{{.Config.Entrypoint}} {{.Config.Cmd}}'

say "podman run options"
pick_run_opts "$IMAGE"
run() { # shellcheck disable=SC2086
    podman run --rm --network=none $RUN_OPTS "$@"; }

say "kvcached --help"
out=$(run "$IMAGE" --help); printf '%s\n' "$out" | head -n 3
run --entrypoint /opt/kvcached/bin/python "$IMAGE" -c \
    'import importlib.util as u, sys; print("python", sys.version.split()[0], "| torch:", "present" if u.find_spec("torch") else "absent")'
# The image's default command names flags of `serve`: say so if this code has not one of them.
serve_help=$(run "$IMAGE" serve --help)
for flag in $(podman image inspect "$IMAGE" --format '{{range .Config.Cmd}}{{.}} {{end}}'); do
    case "$flag" in --*) printf '%s\n' "$serve_help" | grep -- "$flag" > /dev/null \
        || echo "WARNING: the default command's $flag is not an option of this code's kvcached serve" ;; esac
done

say "serve --print-config"
run "$IMAGE" serve --config /etc/kvcached/kvcached.toml --print-config \
    | python3 -c 'import json, sys; c = json.load(sys.stdin); print("sections:", ", ".join(c))'

say "serve: a short real run as the chart runs it (uid 0, no capability, read-only root; state on tmpfs)"
mkdir -p "$WORK/etc"
cat > "$WORK/etc/kvcached.toml" <<'EOF'
[kv]
ram_gib = 0.0625
ssd_dir = "/var/lib/kvcached/ssd"
ssd_gib = 0.25
index_dir = "/var/lib/kvcached/index"

[grpc]
listen = ["unix:/run/kvcached/api.sock"]

[agent]
socket = "/run/kvcached/agent.sock"

[metrics]
listen = "127.0.0.1:9464"
EOF
NAME=kvcached-smoke-$$
# shellcheck disable=SC2086
podman run -d --name "$NAME" --network=none $RUN_OPTS --user 0:0 --cap-drop=ALL \
    --read-only --security-opt no-new-privileges --tmpfs /tmp \
    --tmpfs /var/lib/kvcached:mode=0700 --tmpfs /run/kvcached:mode=0755 \
    -v "$WORK/etc:/etc/kvcached:ro" "$IMAGE" serve --config /etc/kvcached/kvcached.toml --rolling > /dev/null
trap 'podman rm -f "$NAME" > /dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
ready=0
for _ in $(seq 1 60); do
    if podman logs "$NAME" 2>&1 | grep ' msg=ready ' > /dev/null; then ready=1; break; fi
    [ "$(podman inspect "$NAME" --format '{{.State.Running}}')" = true ] || break
    sleep 0.5
done
podman logs "$NAME" 2>&1
[ "$ready" = 1 ] || die "the daemon did not log ready"
T=unix:/run/kvcached/api.sock
out=$(podman exec "$NAME" kvcached stat --target "$T"); printf '%s\n' "$out" | head -n 3
podman exec "$NAME" sh -ec "
    D=\$(kvcached hash --model demo --dtype bf16 --block-tokens 4 1 2 3 4)
    head -c 65536 /dev/urandom > /tmp/block
    kvcached put --target $T --model demo \"\$D:0\" /tmp/block
    kvcached get --target $T \"\$D:0\" /tmp/back
    cmp /tmp/block /tmp/back && echo 'put/get: the same 65536 bytes back'"
podman exec "$NAME" python3 -c 'import urllib.request as r
t = r.urlopen("http://127.0.0.1:9464/metrics").read().decode().splitlines()
print("metrics:", len(t), "lines;", next(l for l in t if l.startswith("kvcached_build_info")))'
podman stop -t 30 "$NAME" > /dev/null
code=$(podman inspect "$NAME" --format '{{.State.ExitCode}}')
podman logs "$NAME" 2>&1 | tail -n 2
echo "exit code after SIGTERM: $code"
[ "$code" = 0 ] || die "the daemon did not stop cleanly"

say "ok: $IMAGE"
