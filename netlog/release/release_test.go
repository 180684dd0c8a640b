package release

import (
	"net/netip"
	"testing"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

func TestDecide(t *testing.T) {
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	const margin = 3 * time.Second
	n2 := netip.MustParseAddr("10.0.0.2")
	n2b := netip.MustParseAddr("10.0.0.22") // a failed node's address, taken over by node2 later
	ago := func(d time.Duration) time.Time { return now.Add(-d) }
	// The usual finished flow to node2: FIN sent, last segment and last append 10 s ago.
	fin := Flow{Node: "node2", Conn: to(n2), HasState: true, FinSent: true, StateAge: 10 * time.Second, LastAppend: ago(10 * time.Second)}
	with := func(f Flow, change func(*Flow)) Flow { change(&f); return f }
	idle := func(at time.Time) map[string]Watermark { // node2 runs no job; it answered at at
		return map[string]Watermark{"node2": {At: at, Addrs: []netip.Addr{n2}}}
	}
	held := func(at time.Time) map[string]Watermark { // a running job of node2 was snapshotted at at
		return map[string]Watermark{"node2": {At: at, Held: true, Addrs: []netip.Addr{n2}}}
	}
	tests := []struct {
		name  string
		flow  Flow
		marks map[string]Watermark
		want  Verdict
		ask   bool
	}{
		{"open connection kept whatever the watermark", with(fin, func(f *Flow) { f.FinSent = false }), idle(now), Open, false},
		{"open connection without flow state", Flow{Node: "node2", Conn: to(n2), LastAppend: ago(time.Hour)}, idle(now), Open, false},
		{"FIN sent, receiver idle since after the last segment: freed", fin, idle(ago(time.Second)), Free, false},
		{"RST sent: finished too", with(fin, func(f *Flow) { f.FinSent, f.RstSent = false, true }), idle(ago(time.Second)), Free, false},
		{"sending job ended, FIN never seen", with(fin, func(f *Flow) { f.FinSent = false; f.SenderGone = true }), idle(now), Free, false},
		{"sending job ended, flow state evicted", with(fin, func(f *Flow) { f.HasState, f.FinSent, f.SenderGone = false, false, true }), idle(now), Free, false},
		{"FIN seen but flow state lost: unknown sender, kept", with(fin, func(f *Flow) { f.HasState = false }), idle(now), Open, false},
		{"sending socket gone, flow state evicted, job runs on: freed", with(fin, func(f *Flow) { f.HasState, f.FinSent, f.SocketGone = false, false, true }), idle(now), Free, false},
		{"sending socket gone, last data after the held watermark: kept", with(fin, func(f *Flow) { f.HasState, f.FinSent, f.SocketGone = false, false, true }), held(ago(8 * time.Second)), Held, true},
		{"finished and older than a held watermark: freed", fin, held(ago(5 * time.Second)), Free, false},
		{"FIN sent but last data after the held watermark: kept, a snapshot would help", fin, held(ago(8 * time.Second)), Held, true},
		{"last data after the watermark, receiver idle: settling", fin, idle(ago(8 * time.Second)), Settling, true},
		{"no watermark known yet: kept, ask", fin, nil, Unknown, true},
		{"watermark of another node only: kept, ask", fin, map[string]Watermark{"node3": {At: now, Addrs: []netip.Addr{n2}}}, Unknown, true},
		{"watermark does not cover the destination address: kept", with(fin, func(f *Flow) { f.Conn = to(n2b) }), idle(now), Unknown, true},
		{"IPv4-mapped destination is covered", with(fin, func(f *Flow) { f.Conn = to(netip.AddrFrom16(n2.As16())) }), idle(now), Free, false},
		{"no alive member holds the destination: kept, nobody to ask", with(fin, func(f *Flow) { f.Node = "" }), idle(now), Orphan, false},
		{"no alive member holds the destination, an hour after its last segment and its orphaning: freed",
			with(fin, func(f *Flow) {
				f.Node, f.StateAge, f.LastAppend, f.OrphanSince = "", OrphanKeep, ago(OrphanKeep), ago(OrphanKeep)
			}), nil, Free, false},
		{"receiver failed a minute ago, two hours after the last segment: kept for its restore",
			with(fin, func(f *Flow) {
				f.Node, f.StateAge, f.LastAppend, f.OrphanSince = "", 2*time.Hour, ago(2*time.Hour), ago(time.Minute)
			}), nil, Orphan, false},
		{"orphaned since an unknown time (zero: now): kept",
			with(fin, func(f *Flow) { f.Node, f.StateAge, f.LastAppend = "", 2*time.Hour, ago(2*time.Hour) }), nil, Orphan, false},
		{"margin: last segment exactly margin before the watermark: freed",
			with(fin, func(f *Flow) { f.StateAge, f.LastAppend = 5*time.Second, ago(5*time.Second) }), idle(ago(2 * time.Second)), Free, false},
		{"margin: one ms short: kept",
			with(fin, func(f *Flow) { f.StateAge, f.LastAppend = 5*time.Second, ago(5*time.Second) }), idle(ago(2*time.Second + time.Millisecond)), Settling, true},
		{"margin not yet past: asking is pointless",
			with(fin, func(f *Flow) { f.StateAge, f.LastAppend = time.Second, ago(time.Second) }), nil, Unknown, false},
		{"late segment in the flow state counts although not yet appended",
			with(fin, func(f *Flow) { f.StateAge = time.Second }), idle(ago(time.Second)), Settling, false},
		{"late append counts although the flow state is older",
			with(fin, func(f *Flow) { f.LastAppend = ago(time.Second) }), idle(ago(time.Second)), Settling, false},
		{"record timestamp stands in for the append, which lagged in the ring buffer",
			with(fin, func(f *Flow) {
				f.HasState, f.FinSent, f.SenderGone = false, false, true
				f.SentAge, f.HasSentAge, f.LastAppend = 10*time.Second, true, now
			}),
			idle(ago(5 * time.Second)), Free, false},
		{"record timestamp too recent",
			with(fin, func(f *Flow) {
				f.HasState, f.FinSent, f.SenderGone = false, false, true
				f.SentAge, f.HasSentAge = 4*time.Second, true
			}),
			idle(ago(2 * time.Second)), Settling, true},
		{"flow state later than the newest record (a FIN or an ACK left since)",
			with(fin, func(f *Flow) { f.StateAge, f.SentAge, f.HasSentAge = 4*time.Second, 10*time.Second, true }),
			idle(ago(2 * time.Second)), Settling, true},
		{"negative flow state age is now", with(fin, func(f *Flow) { f.StateAge, f.LastAppend = -time.Hour, time.Time{} }), idle(now), Settling, false},
		{"nothing says when it last sent: never freed", with(fin, func(f *Flow) { f.HasState, f.SenderGone, f.LastAppend = false, true, time.Time{} }), idle(now), Unknown, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := Decide(Input{Now: now, Margin: margin, Flows: []Flow{tc.flow}, Marks: tc.marks})
			if len(got) != 1 || got[0].Verdict != tc.want || got[0].Ask != tc.ask {
				t.Fatalf("Decide = %+v (%v), want %v ask=%v", got, got[0].Verdict, tc.want, tc.ask)
			}
		})
	}
}

func TestDecideDefaultMargin(t *testing.T) {
	now := time.Now()
	n2 := netip.MustParseAddr("10.0.0.2")
	marks := map[string]Watermark{"node2": {At: now, Addrs: []netip.Addr{n2}}}
	flows := []Flow{
		{Node: "node2", Conn: to(n2), SenderGone: true, LastAppend: now.Add(-DefaultMargin + time.Millisecond)},
		{Node: "node2", Conn: to(n2), SenderGone: true, LastAppend: now.Add(-DefaultMargin)},
	}
	got := Decide(Input{Now: now, Flows: flows, Marks: marks})
	if got[0].Verdict != Settling || got[1].Verdict != Free {
		t.Fatalf("with the default margin: %+v", got)
	}
}

func TestVerdictSnapshotHelps(t *testing.T) {
	for v, want := range map[Verdict]bool{Open: true, Held: true, Orphan: false, Unknown: false, Settling: false, Free: false} {
		if v.SnapshotHelps() != want {
			t.Errorf("%v.SnapshotHelps() = %v, want %v", v, !want, want)
		}
		if v.String() == "invalid" {
			t.Errorf("verdict %d has no name", v)
		}
	}
}

func TestReceiveWatermark(t *testing.T) {
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	ago := func(d time.Duration) time.Time { return now.Add(-d) }
	tests := []struct {
		name     string
		jobs     []Job
		want     time.Time
		wantHeld bool
	}{
		{"no job: now", nil, now, false},
		{"only ended jobs: now", []Job{{Started: ago(time.Hour), Replicated: ago(time.Minute)}}, now, false},
		{"one running job: its newest replicated snapshot",
			[]Job{{Running: true, Started: ago(time.Hour), Replicated: ago(time.Minute)}}, ago(time.Minute), true},
		{"the oldest over running jobs",
			[]Job{{Running: true, Started: ago(time.Hour), Replicated: ago(time.Minute)}, {Running: true, Started: ago(time.Hour), Replicated: ago(2 * time.Minute)}, {Started: ago(2 * time.Hour), Replicated: ago(time.Hour)}},
			ago(2 * time.Minute), true},
		{"running job without a replicated snapshot counts from its start",
			[]Job{{Running: true, Started: ago(10 * time.Second)}, {Running: true, Started: ago(time.Hour), Replicated: ago(time.Minute)}}, ago(time.Minute), true},
		{"a start older than the others' snapshots wins",
			[]Job{{Running: true, Started: ago(10 * time.Minute)}, {Running: true, Started: ago(time.Hour), Replicated: ago(time.Minute)}}, ago(10 * time.Minute), true},
		{"a snapshot stamped in the future (clock step) is capped at now",
			[]Job{{Running: true, Started: ago(time.Hour), Replicated: now.Add(time.Minute)}}, now, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, held := ReceiveWatermark(now, tc.jobs)
			if !got.Equal(tc.want) || held != tc.wantHeld {
				t.Fatalf("ReceiveWatermark = %v held=%v, want %v held=%v", got, held, tc.want, tc.wantHeld)
			}
		})
	}
}

// to is a logged connection toward dst, from the sender's side.
func to(dst netip.Addr) tcpflow.Tuple {
	return tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:40000"), Remote: netip.AddrPortFrom(dst, 5201)}
}
