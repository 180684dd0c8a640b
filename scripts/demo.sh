#!/usr/bin/env bash
# The main job, as far as ftkit goes today:
#   1. a lab cluster (3 nodes + 1 spare) with an ftkit agent in every host;
#   2. a real parallel program (testdata/ringstencil, 3 ranks exchanging halos over TCP) under ftwrap;
#   3. a memory-heavy job under ftwrap on node2, snapshotted and replicated on its protector (node3),
#      node2 crashed (power cut), the job restored on spare1 from the replica, and its output compared
#      with a failure-free run.
# Fail-over of ranks with live TCP peers (log replay) is not implemented yet: the demo says so.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$PWD/bin
ID=ftdemo
SUBNET=10.202.0.0/24
WORK=$(mktemp -d /tmp/ftkit-demo.XXXXXX)
lab() { "$BIN/ftctl" lab --id "$ID" "$@"; }
ctl() { "$BIN/ftctl" --lab "$ID" "$@"; }
sock() { echo "/run/ftkit/labs/$ID.d/$1/agent.sock"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}'; }

cleanup() {
	jobs -p | xargs -r kill 2>/dev/null || true
	lab down >/dev/null 2>&1 || true
	rm -rf "$WORK"
}
trap cleanup EXIT
lab down >/dev/null 2>&1 || true

echo "== 1. lab: 3 nodes + 1 spare, an agent in each (protection ring node1 -> node2 -> node3 -> node1)"
t=$(now)
lab up --nodes 3 --spares 1 --subnet "$SUBNET" --interval 1h
echo "   lab and agents up in $(secs "$t") s"

echo "== 2. ringstencil under ftwrap: 3 ranks on node1..3, 300 iterations, 64 KiB halos both ways"
PEERS=10.202.0.11:7100,10.202.0.12:7100,10.202.0.13:7100
t=$(now)
for r in 0 1 2; do
	FTKIT_AGENT_SOCKET=$(sock "node$((r + 1))") "$BIN/ftwrap" --name "rank$r" -- \
		"$BIN/ringstencil" --rank $r --peers "$PEERS" --iters 300 --block 65536 >"$WORK/ring.$r" &
done
wait
echo "   finished in $(secs "$t") s"
cat "$WORK"/ring.*
[ "$(cut -d' ' -f4 "$WORK"/ring.* | sort -u | wc -l)" = 1 ] && echo "   all ranks agree"

echo "== 3. a 200 MB job on node2: snapshots replicated on node3, node2 crashes, restore on spare1"
MEM=("$BIN/memcounter" --mb 200 --steps 200 --delay 50ms)
"${MEM[@]}" --delay 0s >"$WORK/mem.reference"
FTKIT_AGENT_SOCKET=$(sock node2) "$BIN/ftwrap" --name mem -- "${MEM[@]}" >"$WORK/mem.out" 2>"$WORK/mem.err" &
WRAP=$!
sleep 2
for i in 1 2; do
	ctl checkpoint --host node2 | sed 's/^/   /'
	sleep 1
done
SNAP=$(ctl snapshots --host node3 --json | awk -F'"' '/"id":/{print $4; exit}')
sleep 1
echo "   lines printed before the crash: $(wc -l <"$WORK/mem.out")"
t=$(now)
lab crash node2
ctl restore --host spare1 --snapshot "$SNAP" | sed 's/^/   /'
echo "   restore on spare1 (fetch from node3, verify, CRIU restore): $(secs "$t") s"
wait "$WRAP"
echo "   ftwrap exit status: $?  (it followed the job from node2 to spare1)"
if cmp -s "$WORK/mem.out" "$WORK/mem.reference"; then
	echo "   output IDENTICAL to the failure-free run ($(wc -l <"$WORK/mem.out") lines, no gap, no repeat)"
else
	echo "   output DIFFERS from the failure-free run:"
	diff "$WORK/mem.reference" "$WORK/mem.out" | head -5
	exit 1
fi
ctl status | sed 's/^/   /'

echo "== 4. not yet: fail-over of ranks with live TCP peers (restore + replay of the peers' logged bytes)."
echo "   A crash of a ringstencil host today leaves its peers waiting; that is the next issue."
echo "== done (the lab is removed on exit)"
