package e2e

import (
	"fmt"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/tcpflow"
)

// rankSockets is the TCP_INFO of host's established sockets to or from port (the ring's), by 4-tuple,
// read with sock_diag in host's network namespace.
func rankSockets(t *testing.T, c *labcluster.Cluster, host string, port uint16) map[tcpflow.Tuple]netlink.TCPInfo {
	t.Helper()
	socks, err := c.Lab.TCPSockets(host)
	if err != nil {
		t.Fatalf("sockets of %s: %v", host, err)
	}
	out := map[tcpflow.Tuple]netlink.TCPInfo{}
	for f, info := range socks {
		if f.Local.Port() == port || f.Remote.Port() == port {
			out[f] = info
		}
	}
	return out
}

// TestFailoverRestoresSegmentSize crashes node2 after its snapshot and checks that the restored rank's
// sockets on spare1 send segments of the size node2's did, over the same path MTU, with the same options
// and window scales. A socket CRIU restores sizes its segments at the repair-mode connect, before its MSS
// is set: without the fail-over's restore.LowerPathMTU around CRIU's restore, these sockets send 524-byte
// segments (measured: snd_mss 1448 -> 524); a route left lowered would show as pmtu 1499.
func TestFailoverRestoresSegmentSize(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	const port = 7390
	args := ringArgs(3000, 4<<10, 10*time.Millisecond)
	want := reference(t, 3, args)
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	rg := startRing(t, c, 3, port, args)
	rg.waitProtected(t, 2*time.Minute)
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	before := rankSockets(t, c, "node2", port)
	if len(before) != 2 {
		t.Fatalf("rank 1 on node2 has %d ring connections, want 2: %v", len(before), before)
	}
	rg.crashAfterSnapshot(t, "node2", 100, "spare1", false)

	// Once each restored socket has sent a few blocks, its segment size is settled.
	deadline := time.Now().Add(time.Minute)
	var after map[tcpflow.Tuple]netlink.TCPInfo
	for {
		after = rankSockets(t, c, "spare1", port)
		settled := len(after) == len(before)
		for k := range before {
			settled = settled && after[k].Bytes_acked >= 64<<10
		}
		if settled {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("rank 1's restored sockets on spare1 did not each send 64 KiB within a minute: %v", after)
		}
		time.Sleep(50 * time.Millisecond)
	}
	for k, o := range before {
		a := after[k]
		t.Logf("%v: snd_mss %d -> %d, pmtu %d -> %d, advmss %d -> %d", k, o.Snd_mss, a.Snd_mss, o.Pmtu, a.Pmtu, o.Advmss, a.Advmss)
		if a.Snd_mss != o.Snd_mss || a.Pmtu != o.Pmtu || a.Options != o.Options || a.Snd_wscale != o.Snd_wscale || a.Rcv_wscale != o.Rcv_wscale {
			t.Errorf("%v restored on spare1: %s; on node2 before the crash: %s", k, segInfo(a), segInfo(o))
		}
	}
	checkRanks(t, rg.wait(t, 3*time.Minute), want)
}

func segInfo(i netlink.TCPInfo) string {
	return fmt.Sprintf("snd_mss %d pmtu %d options %#x wscale %d,%d", i.Snd_mss, i.Pmtu, i.Options, i.Snd_wscale, i.Rcv_wscale)
}
