package coordinated

import (
	"errors"
	"maps"
	"net/netip"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestCheckCut: a cut is recorded only if every byte between its jobs is in exactly one place: in its
// sender's send queue (not acknowledged) or received by the other end.
func TestCheckCut(t *testing.T) {
	a := netip.MustParseAddrPort("10.77.1.2:7000")
	b := netip.MustParseAddrPort("10.77.1.3:41000")
	conn := func(local, remote netip.AddrPort, inq, outq, outqLen uint32) ckpt.Conn {
		return ckpt.Conn{Tuple: tcpflow.Tuple{Local: local, Remote: remote}, InqSeq: inq, OutqSeq: outq, OutqLen: outqLen}
	}
	connecting := func(local, remote netip.AddrPort) ckpt.Conn {
		return ckpt.Conn{Tuple: tcpflow.Tuple{Local: local, Remote: remote}, OutqSeq: 1001, Connecting: true}
	}
	cut := func(ca, cb ckpt.Conn) []clusterapi.CutPart {
		return []clusterapi.CutPart{{Job: "ja", Conns: []ckpt.Conn{ca}}, {Job: "jb", Conns: []ckpt.Conn{cb}}}
	}
	for _, tt := range []struct {
		name  string
		parts []clusterapi.CutPart
		torn  string // "" = consistent
		other string // a refusal that is not a torn cut
	}{
		// a wrote up to 1000, b received up to 1000; b wrote up to 5000, a received it all.
		{"quiet", cut(conn(a, b, 5000, 1000, 0), conn(b, a, 1000, 5000, 0)), "", ""},
		// a's last 200 bytes not acknowledged; b received 100 of them: the other 100 are re-sent by a.
		{"in flight, sender holds them", cut(conn(a, b, 5000, 1000, 200), conn(b, a, 900, 5000, 0)), "", ""},
		{"sequence numbers wrap", cut(conn(a, b, 5000, 100, 300), conn(b, a, 4294967200, 5000, 0)), "", ""},
		// b's dump came before 100 bytes arrived; a's after their acknowledgment: in neither.
		{"acknowledged after the receiver's dump", cut(conn(a, b, 5000, 1000, 0), conn(b, a, 900, 5000, 0)), "in neither snapshot", ""},
		{"received beyond what was written", cut(conn(a, b, 5000, 1000, 0), conn(b, a, 1100, 5000, 0)), "beyond what job ja had written", ""},
		{"a connection leaving the run", []clusterapi.CutPart{{Job: "ja", Conns: []ckpt.Conn{conn(a, b, 1, 1, 0)}}}, "", "not a job of the run"},
		{"no connections", []clusterapi.CutPart{{Job: "ja"}, {Job: "jb"}}, "", ""},
		// A connect pending at a's dump (InqSeq the kernel's 0): with b not yet holding the connection,
		// the restored a connects again; with b holding it accepted, the two snapshots disagree.
		{"a connect not yet accepted", []clusterapi.CutPart{{Job: "ja", Conns: []ckpt.Conn{connecting(a, b)}}, {Job: "jb"}}, "", ""},
		{"a connect accepted after the connecting end's dump", cut(connecting(a, b), conn(b, a, 1001, 3000000000, 0)), "still connecting in job ja's snapshot, accepted in job jb's", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := Check(tt.parts)
			var torn *TornError
			switch {
			case tt.torn == "" && tt.other == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tt.torn != "" && (!errors.As(err, &torn) || !strings.Contains(err.Error(), tt.torn)):
				t.Fatalf("got %v, want a torn cut naming %q", err, tt.torn)
			case tt.other != "" && (err == nil || errors.As(err, &torn) || !strings.Contains(err.Error(), tt.other)):
				t.Fatalf("got %v, want a refusal naming %q (not retried)", err, tt.other)
			}
		})
	}
}

// TestPlaceParts: a rollback restores each part where its job runs now, else on its host, else (its host
// failed) on the failure's target; never beside a copy that runs elsewhere, and never without knowing
// where every job of the run is.
func TestPlaceParts(t *testing.T) {
	cut := &Cut{Run: "r", ID: "cut-1", Parts: []clusterapi.CutPart{
		{Job: "a-00000001", Host: "n1", Snapshot: "s1"},
		{Job: "b-00000002", Host: "n2", Snapshot: "s2"},
	}}
	held := func(p clusterapi.CutPart) bool { return p.Job == "b-00000002" }
	type placed struct{ target, source string }
	for _, tt := range []struct {
		name   string
		where  map[string]string
		alive  []string
		target string
		want   map[string]placed // by job
		err    string
	}{
		{"both run on their hosts", map[string]string{"a-00000001": "n1", "b-00000002": "n2"}, []string{"n1", "n2", "n3"}, "",
			map[string]placed{"a-00000001": {"n1", ""}, "b-00000002": {"n2", ""}}, ""},
		{"b moved to n3 after the cut", map[string]string{"a-00000001": "n1", "b-00000002": "n3"}, []string{"n1", "n2", "n3"}, "",
			map[string]placed{"a-00000001": {"n1", ""}, "b-00000002": {"n3", "self"}}, ""},
		{"b ended: restored on its host", map[string]string{"a-00000001": "n1"}, []string{"n1", "n2"}, "",
			map[string]placed{"a-00000001": {"n1", ""}, "b-00000002": {"n2", ""}}, ""},
		{"n2 failed: b on the spare", map[string]string{"a-00000001": "n1"}, []string{"n1", "n3", "s1"}, "s1",
			map[string]placed{"a-00000001": {"n1", ""}, "b-00000002": {"s1", "self"}}, ""},
		{"n2 failed, no target", map[string]string{"a-00000001": "n1"}, []string{"n1", "n3"}, "", nil, "runs nowhere"},
		{"a job that started after the cut", map[string]string{"a-00000001": "n1", "b-00000002": "n2", "c-00000003": "n3"}, []string{"n1", "n2", "n3"}, "", nil, "started after its cut"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			byHost, hosts, err := Place(cut, tt.where, tt.alive, tt.target, "self", held)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("got %v, want an error naming %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := map[string]placed{}
			for _, h := range hosts {
				for _, p := range byHost[h] {
					if p.Target != h {
						t.Errorf("part %s listed under %s, target %s", p.Job, h, p.Target)
					}
					got[p.Job] = placed{p.Target, p.Source}
				}
			}
			if !maps.Equal(got, tt.want) {
				t.Errorf("placed %v, want %v", got, tt.want)
			}
		})
	}
}
