package ckpt

import (
	"net/netip"
	"testing"

	"github.com/ftkit/ftkit/tcpflow"
)

// TestMatchSelects: Match checks only the connections want selects, and names both jobs of a torn pair.
// (agent's TestCheckCut has the cases of the check itself.)
func TestMatchSelects(t *testing.T) {
	a, b := netip.MustParseAddrPort("10.0.0.2:7000"), netip.MustParseAddrPort("10.0.0.2:41000")
	far := netip.MustParseAddrPort("10.0.0.9:7000")
	conn := func(local, remote netip.AddrPort, inq, outq uint32) Conn {
		return Conn{Tuple: tcpflow.Tuple{Local: local, Remote: remote}, InqSeq: inq, OutqSeq: outq}
	}
	parts := []Part{
		{Job: "j1", Conns: []Conn{conn(a, b, 5000, 1000), conn(a, far, 1, 1)}},
		{Job: "j2", Conns: []Conn{conn(b, a, 900, 5000)}}, // received less than j1 had written, all of it acknowledged
	}
	local := func(c Conn) bool { return c.Remote.Addr() == a.Addr() }
	ms := Match(parts, local)
	if len(ms) != 1 || ms[0].Job != "j1" || ms[0].Peer != "j2" || ms[0].Conn.Tuple != parts[0].Conns[0].Tuple {
		t.Fatalf("Match: %+v; want j1's connection to j2, torn, and nothing about the one to %s", ms, far)
	}
	if all := Match(parts, nil); len(all) != 2 || all[1].Peer != "" {
		t.Fatalf("Match of every connection: %+v; want the torn one and the one whose other end is in no part", all)
	}
}

// TestMatchPrefersOwnLoopback: two jobs, each in a network namespace of its own, may each hold a loopback
// connection of the same 4-tuple (two copies of one program, whose client got the same ephemeral port). Each
// is whole in its own job's snapshot; paired with the other job's copy (the last one Match had seen), it was
// reported torn, and a recovery of their node refused both jobs.
func TestMatchPrefersOwnLoopback(t *testing.T) {
	srv, cli := netip.MustParseAddrPort("127.0.0.1:9000"), netip.MustParseAddrPort("127.0.0.1:41000")
	conn := func(local, remote netip.AddrPort, inq, outq uint32) Conn {
		return Conn{Tuple: tcpflow.Tuple{Local: local, Remote: remote}, InqSeq: inq, OutqSeq: outq}
	}
	tests := []struct {
		name  string
		parts []Part
		torn  int
	}{
		{"each whole in its own job", []Part{
			{Job: "j1", Conns: []Conn{conn(srv, cli, 1000, 5000), conn(cli, srv, 5000, 1000)}},
			{Job: "j2", Conns: []Conn{conn(srv, cli, 3_000_000_000, 7_000_000), conn(cli, srv, 7_000_000, 3_000_000_000)}},
		}, 0},
		{"torn in its own job", []Part{
			{Job: "j1", Conns: []Conn{conn(srv, cli, 900, 5000), conn(cli, srv, 5000, 1000)}},
			{Job: "j2", Conns: []Conn{conn(srv, cli, 1000, 5000), conn(cli, srv, 5000, 1000)}},
		}, 1},
		{"ends in two jobs (one network namespace)", []Part{
			{Job: "j1", Conns: []Conn{conn(srv, cli, 1000, 5000)}},
			{Job: "j2", Conns: []Conn{conn(cli, srv, 5000, 1000)}},
		}, 0},
		// j3 runs in a namespace of its own and holds both ends of its copy: j1's end is j2's, whatever
		// order the parts come in (a 4-tuple is unique in a namespace, so j3's copy of j1's own tuple
		// pairs with j3's, not with j1's).
		{"ends in two jobs, a whole copy in a third", []Part{
			{Job: "j1", Conns: []Conn{conn(srv, cli, 1000, 5000)}},
			{Job: "j2", Conns: []Conn{conn(cli, srv, 5000, 1000)}},
			{Job: "j3", Conns: []Conn{conn(srv, cli, 3_000_000_000, 7_000_000), conn(cli, srv, 7_000_000, 3_000_000_000)}},
		}, 0},
		{"a whole copy first, then ends in two jobs", []Part{
			{Job: "j3", Conns: []Conn{conn(srv, cli, 3_000_000_000, 7_000_000), conn(cli, srv, 7_000_000, 3_000_000_000)}},
			{Job: "j1", Conns: []Conn{conn(srv, cli, 1000, 5000)}},
			{Job: "j2", Conns: []Conn{conn(cli, srv, 5000, 1000)}},
		}, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if ms := Match(tc.parts, nil); len(ms) != tc.torn {
				t.Fatalf("Match: %+v; want %d torn connections", ms, tc.torn)
			}
		})
	}
}

// TestMatchUnackedFIN: a snapshot that caught a socket in FIN_WAIT1 (its FIN and last bytes not acknowledged)
// and the peer's, which acknowledged nothing more, are one cut: CRIU's OutqSeq counts the FIN, OutqLen does
// not, and the check took the first unacknowledged byte for one after the peer's receive point (torn).
func TestMatchUnackedFIN(t *testing.T) {
	a, b := netip.MustParseAddrPort("10.0.0.2:7000"), netip.MustParseAddrPort("10.0.0.3:41000")
	tests := []struct {
		name string
		rcvd uint32 // the peer's InqSeq
		torn int
	}{
		{"peer received nothing of the last 100 bytes", 4900, 0},
		{"peer received them, not the FIN", 5000, 0},
		{"peer received the FIN", 5001, 0},
		{"peer short of what was acknowledged", 4899, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			parts := []Part{
				// 100 bytes and the FIN (write_seq 5001) queued, unacknowledged: snd_una is 4900.
				{Job: "j1", Conns: []Conn{{Tuple: tcpflow.Tuple{Local: a, Remote: b}, InqSeq: 1, OutqSeq: 5001, OutqLen: 100, FinUnacked: true}}},
				{Job: "j2", Conns: []Conn{{Tuple: tcpflow.Tuple{Local: b, Remote: a}, InqSeq: tc.rcvd, OutqSeq: 1}}},
			}
			if ms := Match(parts, nil); len(ms) != tc.torn {
				t.Fatalf("Match: %+v; want %d torn connections", ms, tc.torn)
			}
		})
	}
}
