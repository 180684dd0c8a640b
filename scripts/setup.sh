#!/usr/bin/env bash
# setup.sh: idempotent machine set-up for ftkit (Debian bookworm, run as root).
#
#   scripts/setup.sh            everything: apt packages, CRIU 4.2.1, Go modules and tools
#   scripts/setup.sh packages   only the Debian packages
#   scripts/setup.sh criu       only CRIU (builds from Debian's source pool, verifies the pinned sha256,
#                               applies criu/patches/*.patch)
#   scripts/setup.sh go         only Go modules and Go tools
#   scripts/setup.sh criu-level prints the patch level the CRIU build carries in its version (any user)
#
# Each part prints how long it took; a part that is already done costs well under a second.
set -euo pipefail

CRIU_VERSION=4.2.1
CRIU_SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
CRIU_BIN=/usr/local/sbin/criu
CACHE=${FTKIT_CACHE:-/var/cache/ftkit}
top=$(cd "$(dirname "$0")/.." && pwd)

# Debian packages: the eBPF toolchain, the lab's tools, CRIU's build dependencies, and Open MPI with two
# unmodified MPI workloads for `ftctl mpirun` (HPCC, LAMMPS and its examples; docs/mpi.md), and headless
# Chromium with a font, which renders `ftctl events --svg` pictures in timeline's browser test; Slurm and
# munge for `ftctl lab up --slurm` (a slurmctld and one slurmd per lab host; docs/operations.md); socat for the
# one-way relay chain test, and MPICH (libmpich-dev's mpicc.mpich) for `ftctl mpirun --impl mpich`: Open MPI
# keeps the higher alternatives priority, so `mpirun` and `mpicc` stay Open MPI's; Debian's mpi4py (over Open
# MPI) for the task farm of issue 11, a program that receives from MPI_ANY_SOURCE; xfsprogs for the test of
# replicas that share their base's blocks on a loop-mounted XFS (ckpt/ship).
PACKAGES=(
	clang llvm libbpf-dev bpftool
	nftables iproute2 iputils-arping util-linux procps psmisc ethtool
	dpkg-dev xz-utils make gcc patch
	libbsd-dev libcap-dev libgnutls28-dev libnet1-dev libnftables-dev libnl-3-dev
	libprotobuf-c-dev libprotobuf-dev pkgconf protobuf-c-compiler protobuf-compiler
	uuid-dev python3-protobuf
	openmpi-bin hpcc lammps lammps-examples
	chromium fonts-dejavu-core
	slurmctld slurmd slurm-client munge xfsprogs
	socat mpich libmpich-dev python3-mpi4py
)

say() { printf 'setup: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }
timed() { # timed NAME CMD...: runs CMD, prints its wall time
	local name=$1 t0 t1; shift
	t0=$(date +%s.%N)
	"$@"
	t1=$(date +%s.%N)
	awk -v n="$name" -v a="$t0" -v b="$t1" 'BEGIN{printf "setup: %-9s %6.1f s\n", n, b-a}' >&2
}


packages() {
	local missing=() p
	local -A installed=()
	# One dpkg-query for all of them: a repeated run costs one process, not one per package.
	while read -r p; do installed[$p]=1; done < <(dpkg-query -W -f='${Package} ${Status}\n' "${PACKAGES[@]}" 2>/dev/null | awk '/ install ok installed$/{print $1}')
	for p in "${PACKAGES[@]}"; do
		[ -n "${installed[$p]:-}" ] || missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	say "installing Debian packages: ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The sid deb-src entry reuses the mirror this machine's apt already uses.
sid_sources() {
	local f=/etc/apt/sources.list.d/ftkit-sid-src.sources uri
	[ -f "$f" ] && return 0
	uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
	[ -n "$uri" ] || uri=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
	[ -n "$uri" ] || die "no Debian mirror found in /etc/apt/sources.list*; add a deb-src entry for sid by hand"
	cat >"$f" <<SRC
Types: deb-src
URIs: $uri
Suites: sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
	apt-get update -qq
}

# The build carries ftkit's patches (criu/patches/*.patch) and says so in its version: 4.2.1.<level>, the
# level being the first 7 hex digits of the patches' SHA-256 as a number (criu.PatchLevel). A CRIU built
# from other patches, or none, is rebuilt; the agent warns about one without them.
criu_level() {
	local h LC_ALL=C # the glob in name order, as Go's fs.Glob
	h=$(cat "$top"/criu/patches/*.patch | sha256sum)
	echo $((16#${h:0:7}))
}

criu_ok() {
	[ -x "$CRIU_BIN" ] || return 1
	local v
	v=$("$CRIU_BIN" --version 2>/dev/null) || return 1
	grep -q "^Version: $CRIU_VERSION.$(criu_level)\$" <<<"$v"
}

criu() {
	if criu_ok; then return 0; fi
	sid_sources
	local dir=$CACHE/criu tarball=criu_${CRIU_VERSION}.orig.tar.xz
	mkdir -p "$dir"
	cd "$dir"
	if [ ! -f "$tarball" ]; then
		say "fetching $tarball with apt-get source"
		# Only the upstream tarball is needed; the Debian packaging part may be absent from the pool.
		local ver
		ver=$(apt-cache showsrc criu | awk '/^Version:/{print $2}' | grep -m1 "^${CRIU_VERSION}-" || true)
		[ -n "$ver" ] || die "Debian's sid sources list no criu ${CRIU_VERSION}; run 'apt-cache showsrc criu' to see what is there"
		apt-get source --download-only -qq "criu=$ver" >/dev/null 2>&1 || true
		[ -f "$tarball" ] || die "apt-get source did not deliver $tarball; check the sid deb-src entry in /etc/apt/sources.list.d/ftkit-sid-src.sources"
	fi
	echo "$CRIU_SHA256  $tarball" | sha256sum -c --quiet - || {
		rm -f "$tarball"
		die "$tarball does not match the pinned sha256 $CRIU_SHA256; removed it, run again"
	}
	rm -rf "criu-$CRIU_VERSION"
	tar xf "$tarball"
	local p
	for p in "$top"/criu/patches/*.patch; do
		patch -s -p1 -d "criu-$CRIU_VERSION" <"$p" || die "$p does not apply to CRIU $CRIU_VERSION"
	done
	say "building CRIU $CRIU_VERSION.$(criu_level)"
	make -s -C "criu-$CRIU_VERSION" -j"$(nproc)" CRIU_VERSION_EXTRA="$(criu_level)" criu >build.log 2>&1 || { tail -30 build.log >&2; die "CRIU build failed, full log in $dir/build.log"; }
	install -D -m 0755 "criu-$CRIU_VERSION/criu/criu" "$CRIU_BIN"
	"$CRIU_BIN" check 2>&1 | grep -q 'Looks good' || { "$CRIU_BIN" check >&2 || true; die "criu check did not say 'Looks good'"; }
	say "CRIU $CRIU_VERSION.$(criu_level) installed at $CRIU_BIN; criu check: Looks good"
}

gomod() {
	cd "$top"
	command -v go >/dev/null || die "go not found on PATH"
	go mod download
	# Go tools pinned in go.mod's tool block (bpf2go, staticcheck) are built on demand by `go tool`.
	go build -o /dev/null tool >/dev/null 2>&1 || true
}

what=${1:-all}
if [ "$what" = criu-level ]; then # what criu.PatchLevel must say (its test compares them)
	criu_level
	exit 0
fi
[ "$(id -u)" = 0 ] || die "run as root: ftkit needs root for CRIU, eBPF and network namespaces"
case $what in
packages) timed packages packages ;;
criu) timed criu criu ;;
go) timed go gomod ;;
all)
	timed packages packages
	timed criu criu
	timed go gomod
	;;
*) die "unknown part '$what' (packages, criu, go, all)" ;;
esac
