#!/usr/bin/env bash
# The main job, as far as ftkit goes today: a lab cluster, a real parallel program across it (failure-free),
# a CRIU snapshot of one rank while the program runs, and a crash of that rank's host.
# Fail-over onto the spare is not implemented yet: the demo says so instead of pretending.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$PWD/bin
FTCTL="$BIN/ftctl"
ID=ftdemo
SUBNET=10.202.0.0/24
WORK=$(mktemp -d /tmp/ftkit-demo.XXXXXX)
lab() { "$FTCTL" lab --id "$ID" "$@"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}'; }

cleanup() {
	# Kill whatever the demo started, then remove the lab even if a step failed.
	jobs -p | xargs -r kill 2>/dev/null || true
	lab down >/dev/null 2>&1 || true
	rm -rf "$WORK"
}
trap cleanup EXIT

lab down >/dev/null 2>&1 || true
echo "== 1. lab: 3 nodes + 1 spare"
t=$(now)
lab up --nodes 3 --spares 1 --subnet "$SUBNET"
echo "   lab up in $(secs "$t") s"
PEERS=10.202.0.11:7100,10.202.0.12:7100,10.202.0.13:7100

run_ring() { # run_ring ITERS DELAY OUTPREFIX: one rank per node, each in its own session (CRIU needs that)
	for r in 0 1 2; do
		lab exec "node$((r + 1))" -- setsid "$BIN/ringstencil" --rank $r --peers "$PEERS" \
			--iters "$1" --block 65536 --delay "$2" </dev/null >"$3.rank$r" 2>&1 &
	done
}

echo "== 2. failure-free run: ringstencil, 3 ranks, 400 iterations, 64 KiB halos both ways"
t=$(now)
run_ring 400 0 "$WORK/free"
wait
echo "   finished in $(secs "$t") s"
cat "$WORK"/free.rank*

echo "== 3. the same program, slower, with a CRIU snapshot of rank 1 (node2) while it runs"
run_ring 400 30ms "$WORK/snap"
sleep 2
pid=$(pgrep -f "ringstencil --rank 1 --peers $PEERS" | head -1)
mkdir -p "$WORK/img"
t=$(now)
nsenter --net=/var/run/netns/$ID-node2 /usr/local/sbin/criu dump -t "$pid" -D "$WORK/img" \
	--tcp-established --network-lock nftables --leave-running -o dump.log
echo "   leave-running snapshot of pid $pid in $(secs "$t") s, $(du -sh "$WORK/img" | cut -f1) of images"
sleep 1

echo "== 4. crash node2 (power cut)"
lab crash node2
sleep 2
lab status
echo "   Fail-over to spare1 (restore the snapshot there, replay the peers' logged bytes) is not"
echo "   implemented yet: ranks 0 and 2 now wait on a dead peer. Stopping them."
jobs -p | xargs -r kill 2>/dev/null || true
wait 2>/dev/null || true
echo "== done (the lab is removed on exit)"
