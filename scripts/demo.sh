#!/usr/bin/env bash
# ftkit's main job, end to end:
#   1. a lab cluster (4 nodes + 1 spare), an ftkit agent in every host, protection ring node1 -> node2 ->
#      node3 -> node4 -> node1, sender-side logging on;
#   2. a real parallel program (testdata/ringstencil: 4 ranks on a ring exchanging 64 KiB halos with both
#      neighbours over TCP every iteration, final checksum over every byte exchanged) under ftwrap, run once
#      without failure;
#   3. the same run again: rank 1's node is snapshotted (replica on node3), keeps computing and exchanging,
#      then node2 is crashed (its network namespace and every process in it vanish). node3 detects it,
#      claims spare1, and spare1 restores rank 1 from the replica with the bytes the other ranks had sent
#      since the snapshot replayed from their logs. The survivors never stop, never roll back.
# It prints both runs' checksums and says "identical" only if they are, the survivors' PIDs before and
# after, and the recovery timeline, which it also draws into bin/demo-recovery.svg (ftctl events --svg). It exits non-zero if recovery did not give the failure-free result.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$PWD/bin
ID=ftdemo
SUBNET=10.202.0.0/24
NODES=4
ITERS=${ITERS:-400}
DELAY=${DELAY:-15ms}
WORK=$(mktemp -d /tmp/ftkit-demo.XXXXXX)
SVG=${SVG:-$BIN/demo-recovery.svg} # the recovery's timeline, kept after the demo (bin/ is not committed)
lab() { "$BIN/ftctl" lab --lab "$ID" "$@"; }
ctl() { "$BIN/ftctl" --lab "$ID" "$@"; }
sock() { echo "/run/ftkit/labs/$ID.d/$1/agent.sock"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="${2:-$(now)}" 'BEGIN{printf "%.2f", b-a}'; }
pids() { # job name -> host PID of each running rank, as the agents report them
	for n in $(seq 1 $NODES); do
		FTKIT_AGENT_SOCKET=$(sock "node$n") "$BIN/ftctl" status --json 2>/dev/null |
			awk -F'"' -v want="$1" '/"name":/{name=$4} /"pid":/{gsub(/[^0-9]/,"",$0); if (name ~ want) print name"="$0}' || true
	done | sort -u | tr '\n' ' '
}

cleanup() {
	jobs -p | xargs -r kill 2>/dev/null || true
	lab down >/dev/null 2>&1 || true
	rm -rf "$WORK"
}
trap cleanup EXIT
lab down >/dev/null 2>&1 || true

echo "== 1. lab: $NODES nodes + 1 spare, an agent in each (ring node1 -> node2 -> node3 -> node4 -> node1)"
t=$(now)
lab up --nodes $NODES --spares 1 --subnet "$SUBNET" --interval 1h
echo "   lab and agents up in $(secs "$t") s"

run() { # run NAME PORT: all ranks under ftwrap, outputs in $WORK/NAME.RANK
	local peers="" r
	for r in $(seq 0 $((NODES - 1))); do peers+="${peers:+,}10.202.0.$((11 + r)):$2"; done
	for r in $(seq 0 $((NODES - 1))); do
		FTKIT_AGENT_SOCKET=$(sock "node$((r + 1))") "$BIN/ftwrap" --name "$1-rank$r" -- \
			"$BIN/ringstencil" --rank $r --peers "$peers" --iters "$ITERS" --block 65536 --delay "$DELAY" \
			--progress 50 >"$WORK/$1.$r" 2>&1 &
	done
}
sums() { grep -h checksum "$WORK/$1".* | sort; }
progress() { local n; n=$(grep -c iteration "$WORK/$1" 2>/dev/null) || true; echo "${n:-0}"; } # of one rank
rank1_at() { test "$(progress ft.1)" -ge "$1"; }                 # rank 1 printed at least $1 of them
wait_for() { # wait_for SECONDS WHAT COMMAND...: poll until COMMAND succeeds; SECONDS is a failure bound only
	local limit=$1 what=$2
	shift 2
	local end=$((SECONDS + limit))
	until "$@"; do
		if [ "$SECONDS" -ge "$end" ]; then
			echo "   $what: not reached within $limit s" >&2
			exit 1
		fi
		sleep 0.1
	done
}

echo "== 2. failure-free run: ringstencil, $NODES ranks, $ITERS iterations, 64 KiB halos both ways, $DELAY compute"
t=$(now)
run ref 7100
wait
echo "   finished in $(secs "$t") s"
sums ref | sed 's/^/   /'

echo "== 3. the same run; node2 (rank 1) snapshotted, then crashed mid-run"
t=$(now)
run ft 7200
# The snapshot is of a rank that computes and exchanges with its neighbours: wait for its first progress line.
wait_for 120 "rank 1 computing" rank1_at 1
# ftctl checkpoint fails unless the snapshot is replicated on node2's protector: recovery needs that copy.
ctl checkpoint --host node2 | sed 's/^/   /'
# Then traffic past the snapshot, which recovery replays: two more progress lines (100 iterations).
AT_SNAPSHOT=$(progress ft.1)
wait_for 120 "rank 1 computing past the snapshot" rank1_at $((AT_SNAPSHOT + 2))
echo "   rank 1 progress at the crash: $(progress ft.1) progress lines, $AT_SNAPSHOT at the snapshot"
BEFORE=$(pids 'ft-rank[023]')
echo "   survivors before: $BEFORE"
tc=$(now)
lab crash node2
echo "   node2 crashed at +$(secs "$t" "$tc") s"
FAILED=0
wait || FAILED=1
echo "   all ranks finished $(secs "$tc") s after the crash (run: $(secs "$t") s)"
AFTER=$(pids 'ft-rank[023]')
echo "   survivors after:  $AFTER"
if [ "$BEFORE" = "$AFTER" ]; then
	echo "   survivors untouched: same processes from start to end, never stopped, never restored"
else
	echo "   survivors DISTURBED: their processes changed"
	FAILED=1
fi
echo "== recovery timeline (ftctl events)"
ctl events | sed 's/^/   /' || true
# The same timeline as a picture: open it in any browser.
if ctl events --svg "$SVG" >/dev/null; then
	echo "   picture of the recovery: $SVG"
else
	echo "   could not draw the recovery timeline into $SVG (the error is above)"
fi
echo "== result"
sums ft | sed 's/^/   /'
if [ "$FAILED" = 0 ] && [ "$(sums ref)" = "$(sums ft)" ] && [ "$(sums ft | wc -l)" = "$NODES" ]; then
	echo "   checksums IDENTICAL to the failure-free run: rank 1 was restored on spare1 with its peers' bytes replayed"
else
	echo "   checksums DIFFER from the failure-free run (or a rank failed): recovery did NOT give the failure-free result"
	for r in $(seq 0 $((NODES - 1))); do echo "   --- rank $r:"; tail -3 "$WORK/ft.$r" | sed 's/^/   /'; done
	exit 1
fi
echo "== done (the lab is removed on exit)"
