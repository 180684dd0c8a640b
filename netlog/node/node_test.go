package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/capture"
	"github.com/ftkit/ftkit/netlog/controller"
	"github.com/ftkit/ftkit/netlog/release"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/tcpflow"
)

// fakeSource is a capture without the kernel: a real log, flow states the test sets, and whether the
// sending cgroup is still protected.
type fakeSource struct {
	log      *netlog.Log
	states   map[tcpflow.Tuple]ebpfprobes.FlowState
	sockets  map[tcpflow.Tuple]bool // LogsSocket's answer (an error for a connection mapped to false)
	protects bool
	onWake   func() // the consumer's next poll, brought forward
	counters capture.Counters
}

func (f *fakeSource) Log() *netlog.Log { return f.log }
func (f *fakeSource) FlowState(c tcpflow.Tuple) (ebpfprobes.FlowState, bool, error) {
	s, ok := f.states[c]
	return s, ok, nil
}
func (f *fakeSource) LogsSocket(c tcpflow.Tuple) (bool, error) {
	logs, ok := f.sockets[c]
	if ok && !logs {
		return false, errors.New("sock_diag: no answer")
	}
	return logs, nil
}
func (f *fakeSource) Protects(uint64) bool                            { return f.protects }
func (f *fakeSource) ProtectCgroup(string) error                      { return nil }
func (f *fakeSource) UnprotectCgroup(string) error                    { return nil }
func (f *fakeSource) Counters() (capture.Counters, error)             { return f.counters, nil }
func (f *fakeSource) Urge() func()                                    { return func() {} }
func (f *fakeSource) TakeParked(context.Context, tcpflow.Tuple) error { return nil }

func (f *fakeSource) Want(tcpflow.Tuple) {
	if f.onWake != nil {
		f.onWake()
	}
}
func (f *fakeSource) Close() error { return f.log.Close() }

// fakeMembers: n2 holds 10.0.0.2 (unless owner is set), and answers watermark questions with mark.
type fakeMembers struct {
	owner  string
	others []string
	mark   release.Watermark
	err    error

	mu        sync.Mutex
	asked     int
	snapshots []string
}

func (m *fakeMembers) Owner(netip.Addr) string { return m.owner }
func (m *fakeMembers) RequestSnapshot(_ context.Context, node string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.snapshots = append(m.snapshots, node)
	return nil
}
func (m *fakeMembers) Others() []string { return m.others }
func (m *fakeMembers) requested() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]string(nil), m.snapshots...)
}
func (m *fakeMembers) Watermark(context.Context, string) (release.Watermark, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.asked++
	return m.mark, m.err
}

var (
	connA = tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:40000"), Remote: netip.MustParseAddrPort("10.0.0.2:5201")}
	connB = tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:40001"), Remote: netip.MustParseAddrPort("10.0.0.2:5201")}
)

const isn = 1000

// appendRecord appends rec to l as the capture would: encoded as the probe writes it, then decoded.
func appendRecord(t *testing.T, l *netlog.Log, rec netlog.Record) {
	t.Helper()
	b, err := netlog.AppendRecord(nil, rec)
	if err != nil {
		t.Fatal(err)
	}
	r, err := netlog.DecodeRecord(b)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Append(r); err != nil {
		t.Fatal(err)
	}
}

// newTestNode is a node whose log holds n bytes of connA from sequence isn.
func newTestNode(t *testing.T, n int, m *fakeMembers) (*Node, *fakeSource, []byte) {
	t.Helper()
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	l, err := netlog.NewLog(netlog.Options{Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	src := &fakeSource{log: l, states: map[tcpflow.Tuple]ebpfprobes.FlowState{}, protects: true}
	payload := make([]byte, n)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	for off := 0; off < n; off += 1400 {
		appendRecord(t, l, netlog.Record{Conn: connA, Seq: isn + uint32(off), CgroupID: 7, Payload: payload[off:min(off+1400, n)]})
	}
	node, err := New(src, Config{Controller: controller.Config{Cap: 64 << 20, High: 0.8, Low: 0.5}, MaxRange: 1<<31 - 1, Members: m, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { node.Close() })
	return node, src, payload
}

// Trim drops what the receiver's snapshot covers, down to the start of its receive-digest block, counts
// only the connections it trimmed, and marks the receiver as relieved.
func TestTrim(t *testing.T) {
	n, _, payload := newTestNode(t, 300_000, &fakeMembers{owner: "n2"})
	at := uint32(isn + 200_000)
	got := n.Trim("n2", []Point{{Conn: connA, Seq: at}, {Conn: connB, Seq: 5}})
	if got != 1 {
		t.Errorf("Trim counted %d connections, want 1 (connB is not logged)", got)
	}
	keep := recvdigest.BlockStart(at)
	r, err := n.Range(context.Background(), "n2", connA, keep)
	if err != nil {
		t.Fatalf("range from the digest block start %d after the trim: %v", keep, err)
	}
	var b bytes.Buffer
	if err := r.Write(&b); err != nil || !bytes.Equal(b.Bytes(), payload[keep-isn:]) {
		t.Errorf("range from %d: %d bytes, %v; want the %d logged from there", keep, b.Len(), err, len(payload[keep-isn:]))
	}
	if _, err := n.Range(context.Background(), "n2", connA, isn); !errors.Is(err, netlog.ErrTrimmed) {
		t.Errorf("range from the trimmed start: %v, want ErrTrimmed", err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.seen["n2"].IsZero() {
		t.Error("Trim did not record when n2 last relieved the log")
	}
}

// TestKnows: a connection is known when the log holds bytes of it or the capture has its live state (a
// protected flow that sent only ACKs); one with neither was sent on by no protected process, or lost its
// live state (LostState: its socket is in a protected cgroup, which a failed lookup does not show).
func TestKnows(t *testing.T) {
	n, src, _ := newTestNode(t, 3000, &fakeMembers{owner: "n2"})
	conn := func(port uint16) tcpflow.Tuple {
		return tcpflow.Tuple{Local: connA.Local, Remote: netip.AddrPortFrom(netip.MustParseAddr("10.0.0.3"), port)}
	}
	src.states[connB] = ebpfprobes.FlowState{SndNxt: 77}
	src.sockets = map[tcpflow.Tuple]bool{conn(1): true, conn(2): false}
	for _, tc := range []struct {
		name            string
		conn            tcpflow.Tuple
		known, lostLive bool
	}{
		{"bytes in the log", connA, true, false},
		{"a live state only", connB, true, false},
		{"a protected process's socket, its live state evicted", conn(1), false, true},
		{"a socket sock_diag did not answer for", conn(2), false, false},
		{"an unprotected process's socket", conn(3), false, false},
	} {
		if got := n.Knows(tc.conn); got != tc.known {
			t.Errorf("%s: Knows(%s) = %v, want %v", tc.name, tc.conn, got, tc.known)
		}
		if got := !tc.known && n.LostState(tc.conn); got != tc.lostLive {
			t.Errorf("%s: LostState(%s) = %v, want %v", tc.name, tc.conn, got, tc.lostLive)
		}
	}
}

// TestHoldTrims: a trim that arrives while a snapshot holds them drops nothing until the last holder
// releases them; then the furthest point asked for each connection applies, and the receiver counts as
// relieved. Without the hold, a receiver's snapshot taken after ours trimmed the block our snapshot's
// sent prefix still had to read (ci138).
func TestHoldTrims(t *testing.T) {
	n, _, payload := newTestNode(t, 300_000, &fakeMembers{owner: "n2"})
	first, second := n.HoldTrims(), n.HoldTrims()
	near, far := uint32(isn+100_000), uint32(isn+200_000)
	if got := n.Trim("n2", []Point{{Conn: connA, Seq: far}}); got != 1 {
		t.Errorf("held Trim counted %d connections, want 1", got)
	}
	n.Trim("n2", []Point{{Conn: connA, Seq: near}}) // an older point, after a newer one: the newer stays
	readAll := func(from uint32) ([]byte, error) { return readConnA(n, from) }
	first()
	first() // a release runs once
	if b, err := readAll(isn); err != nil || !bytes.Equal(b, payload) {
		t.Fatalf("while a holder remains: %d bytes from the start, %v; want all %d", len(b), err, len(payload))
	}
	n.mu.Lock()
	seen := n.seen["n2"]
	n.mu.Unlock()
	if !seen.IsZero() {
		t.Error("n2 counted as relieved before its trim applied")
	}
	second()
	keep := recvdigest.BlockStart(far)
	if b, err := readAll(keep); err != nil || !bytes.Equal(b, payload[keep-isn:]) {
		t.Fatalf("after the release, from the far point's block %d: %d bytes, %v", keep, len(b), err)
	}
	if _, err := readAll(recvdigest.BlockStart(near)); !errors.Is(err, netlog.ErrTrimmed) {
		t.Fatalf("after the release, from the near point's block: %v, want ErrTrimmed (the far point applies)", err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.seen["n2"].IsZero() {
		t.Error("n2 not counted as relieved once its held trim applied")
	}
}

// TestHeldTrimSparesANewConnection: a point held back while a snapshot reads its sent prefixes applies to
// the connection it was checked against only. Freed meanwhile (it finished, its receiver's watermark passed
// it) and followed by a new connection on the same 4-tuple, whose store starts at its own ISN, the old point
// was placed in the new connection's sequence space at the release: ahead of all it had sent, it dropped its
// bytes, and those it sent next, for a recovery that needs them.
func TestHeldTrimSparesANewConnection(t *testing.T) {
	n, src, _ := newTestNode(t, 300_000, &fakeMembers{owner: "n2"})
	release := n.HoldTrims()
	if got := n.Trim("n2", []Point{{Conn: connA, Seq: isn + 200_000}}); got != 1 {
		t.Fatalf("held Trim counted %d connections, want 1", got)
	}
	if err := n.Log().Remove(connA); err != nil { // the old connection freed
		t.Fatal(err)
	}
	const isn2, sent = isn + 50_000, 100_000 // the new connection's ISN: the old point is ahead of its bytes
	payload := make([]byte, 2*sent)
	for i := range payload {
		payload[i] = byte(i * 13)
	}
	for off := 0; off < sent; off += 1400 {
		appendRecord(t, src.log, netlog.Record{Conn: connA, Seq: isn2 + uint32(off), CgroupID: 7, Payload: payload[off:min(off+1400, sent)]})
	}
	release()
	for off := sent; off < len(payload); off += 1400 { // what the new connection sends after the release
		appendRecord(t, src.log, netlog.Record{Conn: connA, Seq: isn2 + uint32(off), CgroupID: 7, Payload: payload[off:min(off+1400, len(payload))]})
	}
	if b, err := readConnA(n, isn2); err != nil || !bytes.Equal(b, payload) {
		t.Fatalf("the new connection on the 4-tuple after the release: %d bytes from its ISN, %v; want all %d it sent", len(b), err, len(payload))
	}
}

// readConnA reads what n's log holds of connA from wire sequence from on, as a restore asks for it.
func readConnA(n *Node, from uint32) ([]byte, error) {
	r, err := n.Range(context.Background(), "n2", connA, from)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	err = r.Write(&b)
	return b.Bytes(), err
}

// A trim point beyond what this host sent on the connection (the live state's snd_nxt) is ignored: no
// receiver holds such bytes, and the log would take the point for one ahead and drop all it logs up to
// it. A receiver's snapshot of a socket still connecting once sent its placeholder 0 so (ci138).
func TestTrimBeyondSentIgnored(t *testing.T) {
	const n = 300_000
	node, src, payload := newTestNode(t, n, &fakeMembers{owner: "n2"})
	src.states[connA] = ebpfprobes.FlowState{SndNxt: isn + n}
	readAll := func(from uint32) ([]byte, error) { return readConnA(node, from) }
	if got := node.Trim("n2", []Point{{Conn: connA, Seq: isn + n + 1<<20}}); got != 0 {
		t.Errorf("Trim beyond snd_nxt counted %d connections, want 0", got)
	}
	if b, err := readAll(isn); err != nil || !bytes.Equal(b, payload) {
		t.Fatalf("after a point beyond snd_nxt: %d bytes from the start, %v; want all %d", len(b), err, len(payload))
	}
	// While a snapshot holds the trims, a point beyond snd_nxt that comes after a good one does not
	// displace it: the good one applies at the release. A point at snd_nxt is a receiver that has
	// everything: it trims down to its block's start.
	release := node.HoldTrims()
	if got := node.Trim("n2", []Point{{Conn: connA, Seq: isn + n}}); got != 1 {
		t.Errorf("held Trim at snd_nxt counted %d connections, want 1", got)
	}
	if got := node.Trim("n2", []Point{{Conn: connA, Seq: isn + n + 1<<20}}); got != 0 {
		t.Errorf("held Trim beyond snd_nxt counted %d connections, want 0", got)
	}
	release()
	keep := recvdigest.BlockStart(isn + n)
	if b, err := readAll(keep); err != nil || !bytes.Equal(b, payload[keep-isn:]) {
		t.Fatalf("after a point at snd_nxt, from its block %d: %d bytes, %v", keep, len(b), err)
	}
}

// TestTrimBlockStartBeyondHalfSpaceIgnored: a trim point within 2^31 behind the live state's snd_nxt whose
// receive-digest block starts more than 2^31 behind it (a receiver's snapshot about 2 GiB behind a fast
// sender) is ignored: the log places the block start within 2^31 of its position, so it read as one about
// 2 GiB ahead, and the trim dropped every byte logged, and everything the sender sent next up to there,
// which a recovery from the receiver's snapshot needs.
func TestTrimBlockStartBeyondHalfSpaceIgnored(t *testing.T) {
	const n = 300_000
	mid, far := uint32(isn+3<<29), uint32(isn+3<<30) // the log has seen about 3 GiB of connA
	sndNxt := far + 3
	for _, tc := range []struct {
		name    string
		seq     uint32
		trimmed bool // the connection counts as trimmed
	}{
		{"block start within 2^31 behind snd_nxt", sndNxt - 1<<31 + recvdigest.BlockSize + 10, true},
		{"point within 2^31, its block start beyond", sndNxt - 1<<31 + 10, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if recvdigest.BlockStart(sndNxt-1<<31+10) >= sndNxt-1<<31 {
				t.Fatal("the test's point does not start its block more than 2^31 behind snd_nxt")
			}
			node, src, _ := newTestNode(t, n, &fakeMembers{owner: "n2"})
			l := src.Log()
			// Reach far in two steps, each under 2^31, so that each unwraps ahead.
			appendRecord(t, l, netlog.Record{Conn: connA, Seq: mid, Payload: []byte("mid")})
			appendRecord(t, l, netlog.Record{Conn: connA, Seq: far, Payload: []byte("far")})
			src.states[connA] = ebpfprobes.FlowState{SndNxt: sndNxt}
			if got := node.Trim("n2", []Point{{Conn: connA, Seq: tc.seq}}); (got == 1) != tc.trimmed {
				t.Errorf("Trim at %d (snd_nxt %d) counted %d connections, want trimmed %v", tc.seq, sndNxt, got, tc.trimmed)
			}
			b, err := l.Bounds(connA)
			if err != nil {
				t.Fatal(err)
			}
			if want := netlog.AnchorEpoch | uint64(recvdigest.BlockStart(tc.seq)); b.Floor > want {
				t.Fatalf("log trimmed to abs %d (wire %d), past the point's block at abs %d (wire %d): a recovery from the point has lost its bytes",
					b.Floor, netlog.Wire(b.Floor), want, netlog.Wire(want))
			}
			for _, seq := range []uint32{mid, far} {
				if _, err := l.Range(connA, netlog.AnchorEpoch|uint64(seq), netlog.AnchorEpoch|uint64(seq+3)); err != nil {
					t.Errorf("bytes at %d, after the point: %v, want them logged", seq, err)
				}
			}
		})
	}
}

// A trim point of a connection with no live state is placed by the log alone, within 2^31 of the
// furthest byte it has seen. One further behind than that (a stale snapshot's point after the connection
// sent on past 2^31 bytes) reads as one about 2^32 ahead, and trimming there would drop the bytes a
// recovery from that snapshot needs; one whose block starts ahead of everything seen cannot be placed
// either. Both are ignored: keeping bytes is safe, dropping them is not.
func TestTrimUnplaceableIgnored(t *testing.T) {
	const n = 300_000
	far := uint32(isn + 3<<30) // the log has seen about 3 GiB of connA: more than 2^31 past the point
	for _, tc := range []struct {
		name     string
		seen     uint32 // a wire sequence of a byte logged after the first n; 0: none
		seq      uint32
		trimmed  bool   // the connection counts as trimmed
		wantFrom uint32 // bytes from here on are still logged, those before it are not
	}{
		{"within the log's position", 0, isn + 200_000, true, recvdigest.BlockStart(isn + 200_000)},
		{"more than 2^31 behind the log's position", far, isn + 200_000, false, isn},
		{"just past the last byte (the receiver has the FIN)", 0, isn + n + 1, true, recvdigest.BlockStart(isn + n + 1)},
		{"ahead of what the log has seen", 0, isn + n + 1<<20, false, isn},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node, src, _ := newTestNode(t, n, &fakeMembers{owner: "n2"})
			l := src.Log()
			if tc.seen != 0 {
				// Reach far in two steps, each under 2^31, so that each unwraps ahead.
				appendRecord(t, l, netlog.Record{Conn: connA, Seq: isn + 3<<29, Payload: []byte("mid")})
				appendRecord(t, l, netlog.Record{Conn: connA, Seq: tc.seen, Payload: []byte("far")})
			}
			if got := node.Trim("n2", []Point{{Conn: connA, Seq: tc.seq}}); (got == 1) != tc.trimmed {
				t.Errorf("Trim counted %d connections, want trimmed %v", got, tc.trimmed)
			}
			b, err := l.Bounds(connA)
			if err != nil {
				t.Fatal(err)
			}
			if want := netlog.AnchorEpoch | uint64(tc.wantFrom); b.Floor > want {
				t.Fatalf("log trimmed to abs %d (wire %d), past abs %d (wire %d): a recovery from the point has lost its bytes",
					b.Floor, netlog.Wire(b.Floor), want, tc.wantFrom)
			}
			if _, err := l.Range(connA, netlog.AnchorEpoch|uint64(tc.wantFrom), netlog.AnchorEpoch|uint64(isn+n)); err != nil {
				t.Errorf("bytes from %d on: %v, want them logged", tc.wantFrom, err)
			}
			if tc.wantFrom > isn {
				if _, err := l.Range(connA, netlog.AnchorEpoch|isn, netlog.AnchorEpoch|isn+1); !errors.Is(err, netlog.ErrTrimmed) {
					t.Errorf("the first byte after the trim: %v, want ErrTrimmed", err)
				}
			}
		})
	}
}

// A point just past the last byte of a connection with no live state (the receiver has the FIN) trims it
// all, also when the FIN's sequence number starts a receive-digest block: the trim's block start is then one
// past everything the log has seen. Before, such a point was taken for one ahead of what was sent and
// ignored, every time (the receiver's point stays there), and the connection's bytes were kept for good
// while its sender ran (release frees only a connection known finished).
func TestTrimPastFinAtBlockStart(t *testing.T) {
	for _, n := range []int{300_000, 5*recvdigest.BlockSize - 1 - isn} { // the FIN inside a block, at a block's start
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			node, src, _ := newTestNode(t, n, &fakeMembers{owner: "n2"})
			fin := uint32(isn + n)
			if got := node.Trim("n2", []Point{{Conn: connA, Seq: fin + 1}}); got != 1 {
				t.Fatalf("Trim at the FIN's end %d counted %d connections, want 1", fin+1, got)
			}
			b, err := src.Log().Bounds(connA)
			if err != nil {
				t.Fatal(err)
			}
			if want := netlog.AnchorEpoch | uint64(recvdigest.BlockStart(fin+1)); b.Floor != want {
				t.Errorf("trimmed to abs %d, want %d (the FIN's block start): %d bytes kept", b.Floor, want, b.Retained)
			}
		})
	}
}

// A range from past the sender's last byte (the receiver's snapshot holds the FIN; or a job restored here
// is still re-sending what its peer had) has nothing to wait for. Before, [from, DataEnd) read as a range
// of almost 4 GiB, which the log never holds: every such range waited catchUpWait, waking the consumer.
func TestRangePastDataEndDoesNotWait(t *testing.T) {
	for _, tc := range []struct {
		name  string
		state ebpfprobes.FlowState
		from  uint32
	}{
		{"the receiver has the FIN", ebpfprobes.FlowState{SndNxt: isn + 5001, FinSent: true}, isn + 5001},
		{"the live state is behind from", ebpfprobes.FlowState{SndNxt: isn + 4000}, isn + 5000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n, src, _ := newTestNode(t, 5000, &fakeMembers{owner: "n2"})
			src.states[connA] = tc.state
			wakes := 0
			src.onWake = func() { wakes++ }
			r, err := n.Range(context.Background(), "n2", connA, tc.from)
			if err != nil || r.Len != 0 {
				t.Fatalf("Range from %d: %d bytes, %v; want none", tc.from, r.Len, err)
			}
			if wakes > 0 {
				t.Errorf("Range from %d, past the live state's data end %d, waited for bytes (%d wakes)", tc.from, tc.state.DataEnd(), wakes)
			}
		})
	}
}

// A range asked for while the last segments the live state shows are still in the ring (the consumer
// reads it at its poll interval) waits until the log holds them, waking the consumer: a range cut short
// of the live state reads as bytes the log lost.
func TestRangeCatchesUp(t *testing.T) {
	n, src, payload := newTestNode(t, 5000, &fakeMembers{owner: "n2"})
	src.states[connA] = ebpfprobes.FlowState{SndNxt: isn + 6000}
	rest := make([]byte, 1000)
	src.onWake = func() {
		src.onWake = nil
		b, err := netlog.AppendRecord(nil, netlog.Record{Conn: connA, Seq: isn + 5000, CgroupID: 7, Payload: rest})
		if err == nil {
			var r netlog.Record
			if r, err = netlog.DecodeRecord(b); err == nil {
				err = src.log.Append(r)
			}
		}
		if err != nil {
			t.Error(err)
		}
	}
	r, err := n.Range(context.Background(), "n2", connA, isn)
	if err != nil || r.Len != 6000 {
		t.Fatalf("Range: %d bytes, %v; want the 6000 the live state shows (%d were logged before the wake)", r.Len, err, len(payload))
	}
}

func TestRange(t *testing.T) {
	tests := []struct {
		name     string
		conn     tcpflow.Tuple
		from     uint32
		state    *ebpfprobes.FlowState // connB's live state, if any
		maxRange int64
		wantLen  int64
		wantLive bool
		wantErr  string
	}{
		{name: "logged bytes from the start", conn: connA, from: isn, wantLen: 5000},
		{name: "logged bytes from the middle", conn: connA, from: isn + 1234, wantLen: 5000 - 1234},
		{name: "from the end: nothing", conn: connA, from: isn + 5000, wantLen: 0},
		{name: "more than one range carries", conn: connA, from: isn, maxRange: 100, wantErr: "more than the 100 one range may carry"},
		{name: "silent since the snapshot: live state, nothing to replay", conn: connB, from: 77,
			state: &ebpfprobes.FlowState{SndNxt: 77}, wantLive: true},
		{name: "a FIN after the last byte counts as nothing sent", conn: connB, from: 77,
			state: &ebpfprobes.FlowState{SndNxt: 78, FinSent: true}, wantLive: true},
		{name: "not logged but the sender went further", conn: connB, from: 77,
			state: &ebpfprobes.FlowState{SndNxt: 90}, wantErr: "connection not in log"},
		{name: "not logged, no live state", conn: connB, from: 77, wantErr: "connection not in log"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			n, src, payload := newTestNode(t, 5000, &fakeMembers{owner: "n2"})
			if tc.maxRange != 0 {
				n.cfg.MaxRange = tc.maxRange
			}
			if tc.state != nil {
				src.states[connB] = *tc.state
			}
			r, err := n.Range(context.Background(), "n2", tc.conn, tc.from)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Range: %+v, %v; want an error containing %q", r, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Range: %v", err)
			}
			if r.From != tc.from || r.Len != tc.wantLen || (r.Live != nil) != tc.wantLive {
				t.Errorf("Range = from %d, %d bytes, live %v; want from %d, %d bytes, live %v", r.From, r.Len, r.Live, tc.from, tc.wantLen, tc.wantLive)
			}
			if r.Write == nil {
				if tc.wantLen != 0 || tc.conn == connA {
					t.Fatal("no writer for a logged range")
				}
				return
			}
			var b bytes.Buffer
			if err := r.Write(&b); err != nil {
				t.Fatalf("write the range: %v", err)
			}
			if want := payload[tc.from-isn:]; !bytes.Equal(b.Bytes(), want) {
				t.Errorf("range wrote %d bytes, want the %d logged from %d", b.Len(), len(want), tc.from)
			}
		})
	}
}

// A finished connection's log is freed once its receiver's watermark is past its last segment, and kept
// with the reason otherwise.
func TestReleaseFinished(t *testing.T) {
	dst := []netip.Addr{connA.Remote.Addr()}
	// The test looks 10 s ahead, so that the last segment (now) is past the release margin.
	now := time.Now().Add(10 * time.Second)
	tests := []struct {
		name      string
		senderRun bool // the sending job still runs
		members   *fakeMembers
		wantAsk   bool
		want      string // the connection's release verdict; "" if freed
	}{
		{name: "sender runs: open", senderRun: true, members: &fakeMembers{owner: "n2", mark: release.Watermark{At: now, Addrs: dst}}, want: "open"},
		{name: "no member holds the destination: orphan", members: &fakeMembers{owner: ""}, want: "orphan"},
		{name: "receiver does not answer: kept", members: &fakeMembers{owner: "n2", err: errors.New("down")}, wantAsk: true, want: "awaiting-watermark"},
		{name: "watermark for other addresses: kept", members: &fakeMembers{owner: "n2", mark: release.Watermark{At: now, Addrs: []netip.Addr{netip.MustParseAddr("10.0.0.9")}}}, wantAsk: true, want: "awaiting-watermark"},
		{name: "receiver's restore point older: held", members: &fakeMembers{owner: "n2", mark: release.Watermark{At: now.Add(-time.Hour), Held: true, Addrs: dst}}, wantAsk: true, want: "held-by-receiver-snapshot"},
		{name: "receiver's restore point after the last segment: freed", members: &fakeMembers{owner: "n2", mark: release.Watermark{At: now, Addrs: dst}}, wantAsk: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := tc.members
			n, src, payload := newTestNode(t, 5000, m)
			src.protects = tc.senderRun
			var events []controller.EventKind
			n.cfg.Event = func(k controller.EventKind) { events = append(events, k) }
			ctx := context.Background()
			n.releaseFinished(ctx, n.Log(), now)
			if tc.wantAsk {
				// The question runs in the background: wait for its answer (the bound is a failure timeout).
				deadline := time.Now().Add(10 * time.Second)
				for {
					m.mu.Lock()
					asked := m.asked
					m.mu.Unlock()
					n.mu.Lock()
					busy := n.asking["n2"]
					n.mu.Unlock()
					if asked > 0 && !busy {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("the receiver was never asked for its watermark")
					}
					time.Sleep(5 * time.Millisecond)
				}
				n.releaseFinished(ctx, n.Log(), now)
			} else if m.asked != 0 {
				t.Errorf("asked for a watermark %d times; nothing it says could free the connection", m.asked)
			}
			conns := n.Conns()
			rel := n.ReleasedSoFar()
			if tc.want == "" {
				if len(conns) != 0 || rel.Conns != 1 || rel.Bytes != int64(len(payload)) {
					t.Errorf("after release: conns %+v, released %+v; want none left, 1 conn and %d bytes freed", conns, rel, len(payload))
				}
				if len(events) != 1 || events[0] != EventReleased {
					t.Errorf("events %v, want one %s", events, EventReleased)
				}
				if st := n.Status(); len(st.Events) != 1 || st.Events[0].Node != "n2" || st.Released != rel {
					t.Errorf("status %+v; want the freeing event and counters", st)
				}
				return
			}
			if len(conns) != 1 || conns[0].Release != tc.want || rel.Conns != 0 {
				t.Errorf("after release: conns %+v, released %+v; want connA kept as %q", conns, rel, tc.want)
			}
		})
	}
}

// Under memory pressure the controller asks the receiving member for a snapshot.
func TestStepRequestsSnapshot(t *testing.T) {
	m := &fakeMembers{owner: "n2"}
	n, _, _ := newTestNode(t, 300_000, m)
	var err error
	if n.ctl, err = controller.New(controller.Config{Cap: 100_000, High: 0.5, Low: 0.25}); err != nil {
		t.Fatal(err)
	}
	n.step(context.Background(), time.Now())
	deadline := time.Now().Add(10 * time.Second)
	for {
		m.mu.Lock()
		got := append([]string(nil), m.snapshots...)
		m.mu.Unlock()
		if len(got) > 0 {
			if got[0] != "n2" {
				t.Errorf("asked %v for a snapshot, want n2", got)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no snapshot requested at %d bytes over a cap of 100000; events %+v", n.Log().Stats().LiveBytes(), n.Status().Events)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A log that lost bytes (segments passed unlogged, records not appended) asks every other member for a
// snapshot at once; while it keeps losing, at most every holeAskEvery, a gap that doubles; not again once
// it stops; from holeAskEvery again after a quiet spell.
func TestHoleAsksEveryMemberForSnapshots(t *testing.T) {
	m := &fakeMembers{owner: "n2", others: []string{"n2", "n3"}}
	n, src, _ := newTestNode(t, 3000, m)
	var received atomic.Uint64 // the receive tap's segments passed unrecorded
	n.cfg.ReceiveHoles = received.Load
	t0 := time.Now()
	holeEvents := func() int {
		k := 0
		for _, e := range n.Status().Events {
			if e.Kind == EventHole {
				k++
			}
		}
		return k
	}
	more := func(c *capture.Counters) { c.UnloggedPassed++ }
	for _, step := range []struct {
		at     time.Duration
		set    func(c *capture.Counters)
		events int // hole events so far
	}{
		{0, func(*capture.Counters) {}, 0},
		{time.Second, more, 1},
		{2 * time.Second, func(c *capture.Counters) { c.FragmentsPassed = 1 }, 1}, // within holeAskEvery
		{time.Second + holeAskEvery, func(*capture.Counters) {}, 2},               // the loss since the last request; the gap doubles
		{time.Minute, func(*capture.Counters) {}, 2},                              // nothing lost since
		{2 * time.Minute, func(c *capture.Counters) { c.AppendErrors = 1 }, 3},    // after a quiet spell: the gap is holeAskEvery again
		{2*time.Minute + holeAskEvery, func(c *capture.Counters) { c.BadRecords = 1 }, 4},
		{2*time.Minute + 2*holeAskEvery, more, 4}, // the gap is 2*holeAskEvery now
		{2*time.Minute + 3*holeAskEvery, more, 5},
		{2*time.Minute + 6*holeAskEvery, more, 5}, // and 4*holeAskEvery
		{2*time.Minute + 7*holeAskEvery, more, 6},
		{time.Hour, func(c *capture.Counters) { c.DropsBackpressure = 100; c.LoggedPassed = 9 }, 6}, // TCP retransmits these: no hole
		{2 * time.Hour, func(*capture.Counters) { received.Add(1) }, 7},                             // the receive tap's hole
	} {
		step.set(&src.counters)
		n.checkHoles(context.Background(), t0.Add(step.at))
		if got := holeEvents(); got != step.events {
			t.Fatalf("at +%s with counters %+v: %d hole events, want %d", step.at, src.counters, got, step.events)
		}
	}
	// Each request asked both other members; the requests run in the background.
	const asks = 7
	for deadline := time.Now().Add(time.Minute); len(m.requested()) < asks*2; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("snapshots requested of %v, want n2 and n3 %d times", m.requested(), asks)
		}
	}
	if got := m.requested(); len(got) != asks*2 || strings.Count(strings.Join(got, " "), "n3") != asks {
		t.Fatalf("snapshots requested of %v, want n2 and n3 %d times", got, asks)
	}
}

// What the source had lost when the node started is not a new hole.
func TestHolesBeforeStartAreNotNew(t *testing.T) {
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	l, err := netlog.NewLog(netlog.Options{Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	src := &fakeSource{log: l, counters: capture.Counters{UnloggedPassed: 5}}
	m := &fakeMembers{others: []string{"n2"}}
	n, err := New(src, Config{Controller: controller.Config{Cap: 64 << 20, High: 0.8, Low: 0.5}, MaxRange: 1 << 20, Members: m, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	n.checkHoles(context.Background(), time.Now())
	if ev := n.Status().Events; len(ev) != 0 {
		t.Fatalf("events %+v, want none", ev)
	}
}

// TestParkCap checks the park's cap from log.park_mib and the log's cap: the agent's default (0) is a
// quarter of the log's, at most capture.DefaultParkCap (256 MiB), since a recovery's read waits for its
// destination's parked clones to be taken into the log; an explicit park_mib is kept as given.
func TestParkCap(t *testing.T) {
	for _, tc := range []struct {
		parkMiB int
		logCap  int64
		want    int64
	}{
		{0, 2400 << 20, 256 << 20}, // a 24 GiB host's default log cap: the park's own cap
		{0, 128 << 20, 32 << 20},   // a small log: a quarter of it
		{0, 1024 << 20, 256 << 20},
		{1024, 2400 << 20, 1 << 30}, // the operator's choice
		{16, 128 << 20, 16 << 20},
	} {
		if got := parkCap(tc.parkMiB, tc.logCap); got != tc.want {
			t.Errorf("parkCap(%d MiB, log cap %d MiB) = %d MiB, want %d MiB", tc.parkMiB, tc.logCap>>20, got>>20, tc.want>>20)
		}
	}
	if capture.DefaultParkCap != 256<<20 {
		t.Errorf("capture.DefaultParkCap is %d MiB; docs/operations.md and agentconfig say 256", capture.DefaultParkCap>>20)
	}
}

// TestConnsFloor checks the trim point a connection's status reports: none before a trim; after one,
// Floor is the trim point even while the bytes just above it are still parked (log.park) and the lowest
// byte retained is later (ci300: a check of First failed, the bytes at the bottom parked).
func TestConnsFloor(t *testing.T) {
	n, _, _ := newTestNode(t, 5000, &fakeMembers{owner: "n2"})
	l := n.Log()
	if cs := n.Conns(); len(cs) != 1 || cs[0].Trimmed || cs[0].Floor != 0 || cs[0].First != isn {
		t.Fatalf("before a trim: %+v, want one connection from %d, no floor", cs, isn)
	}
	if _, err := l.Trim(connA, isn+5000); err != nil {
		t.Fatal(err)
	}
	if err := l.NoteParked(netlog.Record{Conn: connA, Seq: isn + 5000, Parked: 4000}); err != nil {
		t.Fatal(err)
	}
	appendRecord(t, l, netlog.Record{Conn: connA, Seq: isn + 9000, Payload: make([]byte, 100)})
	cs := n.Conns()
	if len(cs) != 1 || !cs[0].Trimmed || cs[0].Floor != isn+5000 || cs[0].First != isn+9000 {
		t.Errorf("trimmed at %d, [%d, %d) parked, [%d, %d) stored: %+v", isn+5000, isn+5000, isn+9000, isn+9000, isn+9100, cs)
	}
}

// TestRangeRefusesAReusedTuple: a new connection on the same 4-tuple whose sequence numbers overlap the
// old one's bytes still in the log (Linux's ISN for a reused tuple overtakes an old stream of more than
// ~125 Mbit/s) has its segments refused as conflicts; a range for its receiver's restore is refused too.
// Before, Range served the old connection's bytes, and the restorer injected them.
func TestRangeRefusesAReusedTuple(t *testing.T) {
	n, src, _ := newTestNode(t, 20_000, &fakeMembers{owner: "n2"}) // the old connection: [isn, isn+20000)
	l := n.Log()
	const newISN = 5000
	fresh := bytes.Repeat([]byte{0xAA}, 3000)
	for off := 0; off < len(fresh); off += 1000 {
		err := l.Append(netlog.Record{Conn: connA, Seq: newISN + 1 + uint32(off), CgroupID: 7, Payload: fresh[off : off+1000]})
		if !errors.Is(err, netlog.ErrConflict) {
			t.Fatalf("the new connection's segment at %d: %v, want a conflict with the old bytes", newISN+1+off, err)
		}
	}
	src.states[connA] = ebpfprobes.FlowState{SndNxt: newISN + 1 + 3000, HasISN: true, ISN: newISN, HasAck: true}
	from := uint32(newISN + 1 + 1000) // the new receiver's snapshot, after 1000 bytes
	r, err := n.Range(context.Background(), "n2", connA, from)
	if !errors.Is(err, netlog.ErrConflict) {
		var b bytes.Buffer
		if err == nil && r.Write != nil {
			r.Write(&b)
		}
		t.Fatalf("Range from %d: %d bytes (%x...), %v; want a refusal naming the conflict", from, r.Len, b.Bytes()[:min(8, b.Len())], err)
	}
}

// TestRangeHoleBelowFrom: a hole in the log below the restore point (a segment lost before the receiver's
// newest snapshot) does not cut a range from that point short. Before, the range ended where the run from
// the lowest retained byte did: 0 bytes, and the restore was refused as "log trimmed or lost". Nor does it
// make the range wait for it: the catch-up asked the consumer for the hole's bytes (a wake) until its wait
// ran out, every connection, as the check of re-sent bytes waited 5 s for each.
func TestRangeHoleBelowFrom(t *testing.T) {
	n, src, _ := newTestNode(t, 0, &fakeMembers{owner: "n2"})
	l := n.Log()
	data := make([]byte, 30_000)
	for i := range data {
		data[i] = byte(i * 13)
	}
	app := func(lo, hi int) {
		for off := lo; off < hi; off += 1000 {
			appendRecord(t, l, netlog.Record{Conn: connA, Seq: isn + uint32(off), CgroupID: 7, Payload: data[off:min(off+1000, hi)]})
		}
	}
	app(0, 10_000)
	app(11_000, 30_000) // [10000, 11000) lost, below the restore point
	src.states[connA] = ebpfprobes.FlowState{SndNxt: isn + 30_000}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	for _, tc := range []struct {
		from    uint32
		want    int64
		wantErr error
		waits   bool // for bytes the live state says were sent after from, missing from the log
	}{
		{from: isn + 20_000, want: 10_000},
		{from: isn + 5_000, want: 5_000, waits: true}, // to the hole: the restorer refuses, knowing the peer sent more
		{from: isn + 10_500, wantErr: netlog.ErrHole, waits: true},
	} {
		wakes := 0
		src.onWake = func() { wakes++ }
		r, err := n.Range(ctx, "n2", connA, tc.from)
		if waited := wakes > 0; waited != tc.waits {
			t.Errorf("Range from %d: waited for missing bytes %v (%d wakes), want %v", tc.from, waited, wakes, tc.waits)
		}
		if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
			t.Errorf("Range from %d: %v, want %v", tc.from, err, tc.wantErr)
			continue
		}
		if err != nil {
			continue
		}
		var b bytes.Buffer
		if r.Write != nil {
			if err := r.Write(&b); err != nil {
				t.Fatal(err)
			}
		}
		off := int(tc.from - isn)
		if r.Len != tc.want || !bytes.Equal(b.Bytes(), data[off:off+int(tc.want)]) {
			t.Errorf("Range from %d: %d bytes (%d written), want %d of the logged ones", tc.from, r.Len, b.Len(), tc.want)
		}
	}
}

// TestOrphanFreedInTime: a finished flow to an address no member holds (a host outside the cluster, or a
// failed node's address nobody took over) is freed OrphanKeep after its last segment. Before, it was kept
// for good: such flows grew the log until its cap stopped every sender of the host.
func TestOrphanFreedInTime(t *testing.T) {
	n, src, payload := newTestNode(t, 300_000, &fakeMembers{owner: ""})
	src.protects = false // the sending job ended
	// The sender's last state is stamped by the kernel's clock (CLOCK_MONOTONIC), which releaseFinished reads
	// for its age: seen now, then, for the call an hour on, seen that long before the real clock. A zero stamp
	// made it as old as the host's uptime: the test passed only on hosts up for more than OrphanKeep.
	seen := func(ago time.Duration) uint64 {
		var mono unix.Timespec
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &mono); err != nil {
			t.Fatal(err)
		}
		return uint64(mono.Nano() - ago.Nanoseconds()) // wraps on a host up for less than ago, as Age expects
	}
	ended := ebpfprobes.FlowState{SndNxt: isn + uint32(len(payload)) + 1, FinSent: true, KtimeNs: seen(0)}
	src.states[connA] = ended
	n.releaseFinished(context.Background(), n.Log(), time.Now())
	if st := n.Log().Stats(); st.RetainedBytes == 0 {
		t.Fatal("a flow to an address no member holds was freed at once: a restore of its receiver may follow")
	}
	wait := release.OrphanKeep + time.Minute
	later := time.Now().Add(wait)
	ended.KtimeNs = seen(wait)
	src.states[connA] = ended
	n.releaseFinished(context.Background(), n.Log(), later)
	if st := n.Log().Stats(); st.RetainedBytes != 0 {
		t.Errorf("%s after the sender ended, the log retains %d bytes of a flow to an address no member holds", wait, st.RetainedBytes)
	}
}

// TestNoSpillBeforeSnapshotsAsked: a log with a spill directory between its low and high watermarks
// spills nothing: its controller asks the receivers for snapshots first, and spills only if they do not
// suffice. Before, the periodic pass spilled every sealed slab above the low watermark within 5 s.
func TestNoSpillBeforeSnapshotsAsked(t *testing.T) {
	const capBytes = 6 << 20
	const high, low = 0.8, 0.5
	logger := slog.New(slog.DiscardHandler)
	// The log's options as Start builds them for a spill directory.
	l, err := netlog.NewLog(netlog.Options{Logger: logger, SpillDir: t.TempDir(), SpillAboveRAM: int64(float64(capBytes) * low)})
	if err != nil {
		t.Fatal(err)
	}
	src := &fakeSource{log: l, states: map[tcpflow.Tuple]ebpfprobes.FlowState{}, protects: true}
	m := &fakeMembers{owner: "n2"}
	n, err := New(src, Config{Controller: controller.Config{Cap: capBytes, High: high, Low: low}, CanSpill: true, MaxRange: 1 << 30, Members: m, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	payload := make([]byte, 3<<20+512<<10) // 3.5 MiB: under the high watermark
	for off := 0; off < len(payload); off += 1400 {
		appendRecord(t, l, netlog.Record{Conn: connA, Seq: isn + uint32(off), CgroupID: 7, Payload: payload[off:min(off+1400, len(payload))]})
	}
	n.step(context.Background(), time.Now())
	if st := l.Stats(); st.SpilledBytes > 0 {
		t.Errorf("below the high watermark, no snapshot asked for (%v), a step spilled %d bytes", m.requested(), st.SpilledRawBytes)
	}
}

// TestEvictedFinishedFlowReleased: a flow whose live state the capture evicted (more protected flows active
// than it keeps), sent by a job that runs on, is finished once its sending socket is gone, and freed by its
// receiver's watermark like any finished flow: never past a protected receiver's restore point. Before, it
// stayed "open" until its job ended; flows to unprotected receivers, which no snapshot trims, grew the log
// until its cap paused every job of the host.
func TestEvictedFinishedFlowReleased(t *testing.T) {
	dst := []netip.Addr{connA.Remote.Addr()}
	// The test looks 10 s ahead, so that the last segment (now) is past the release margin.
	now := time.Now().Add(10 * time.Second)
	idle := release.Watermark{At: now, Addrs: dst} // the receiving node runs no job
	tests := []struct {
		name string
		gone func() (bool, error)
		mark release.Watermark
		want string // the connection's release verdict; "" if freed
	}{
		{"socket gone, receiver runs no job: freed", func() (bool, error) { return true, nil }, idle, ""},
		{"socket gone, receiver's restore point older: held", func() (bool, error) { return true, nil }, release.Watermark{At: now.Add(-time.Hour), Held: true, Addrs: dst}, "held-by-receiver-snapshot"},
		{"socket still there: open", func() (bool, error) { return false, nil }, idle, "open"},
		{"lookup failed: open", func() (bool, error) { return false, errors.New("sock_diag: no answer") }, idle, "open"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := &fakeMembers{owner: "n2", mark: tc.mark}
			n, src, payload := newTestNode(t, 5000, m)
			src.protects = true // the sending job runs on, and connA has no flow state (evicted)
			lookups := 0
			n.cfg.SocketGone = func(c tcpflow.Tuple) (bool, error) {
				if c != connA {
					t.Errorf("looked up %v, want %v", c, connA)
				}
				lookups++
				return tc.gone()
			}
			ctx := context.Background()
			n.releaseFinished(ctx, n.Log(), now)
			// A question for the watermark, if the round asked one, runs in the background: wait for its
			// answer (the bound is a failure timeout), then decide again.
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
				n.mu.Lock()
				busy := n.asking["n2"]
				n.mu.Unlock()
				if !busy {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the receiver never answered the question for its watermark")
				}
			}
			n.releaseFinished(ctx, n.Log(), now)
			if lookups != 1 {
				t.Errorf("the sending socket was looked up %d times in two rounds at once, want 1", lookups)
			}
			conns, rel := n.Conns(), n.ReleasedSoFar()
			if tc.want == "" {
				if len(conns) != 0 || rel.Conns != 1 || rel.Bytes != int64(len(payload)) {
					t.Errorf("conns %+v, released %+v; want connA freed (%d bytes)", conns, rel, len(payload))
				}
				return
			}
			if len(conns) != 1 || conns[0].Release != tc.want || rel.Conns != 0 {
				t.Errorf("conns %+v, released %+v; want connA kept as %q", conns, rel, tc.want)
			}
		})
	}
}

// TestSocketLookupsTakeTurns: a round looks up at most goneLookups sending sockets, the longest unchecked
// first, so that past the probe's live flows every idle one is looked up in turn: in the log's order, the
// first would be looked up again each time they came due and the last never.
func TestSocketLookupsTakeTurns(t *testing.T) {
	n, src, _ := newTestNode(t, 1400, &fakeMembers{owner: "n2"})
	src.protects = true
	const flows = 3 * goneLookups
	for i := 1; i < flows; i++ {
		c := tcpflow.Tuple{Local: netip.AddrPortFrom(connA.Local.Addr(), uint16(41000+i)), Remote: connA.Remote}
		appendRecord(t, n.Log(), netlog.Record{Conn: c, Seq: isn, CgroupID: 7, Payload: []byte("x")})
	}
	looked := map[tcpflow.Tuple]int{}
	n.cfg.SocketGone = func(c tcpflow.Tuple) (bool, error) { looked[c]++; return false, nil }
	now := time.Now().Add(10 * time.Second)
	// Every round comes goneEvery after the last: each flow looked up before is due again.
	for round := range flows / goneLookups {
		n.releaseFinished(context.Background(), n.Log(), now.Add(time.Duration(round)*goneEvery))
	}
	if len(looked) != flows {
		t.Errorf("%d of %d idle flows looked up in %d rounds of %d lookups", len(looked), flows, flows/goneLookups, goneLookups)
	}
}

// TestOrphanKeptAfterItsReceiverFails: a finished flow held for its receiver (whose restore point is older
// than the flow's last segment, more than OrphanKeep ago: an interval auto of hours) becomes an orphan when
// the receiver fails, and is kept OrphanKeep from then for the restore that follows. Before, OrphanKeep
// counted from the last segment alone, so the log went at the failure and the restore was refused.
func TestOrphanKeptAfterItsReceiverFails(t *testing.T) {
	n, src, _ := newTestNode(t, 300_000, &fakeMembers{owner: ""}) // the receiver's node just failed
	src.protects = false                                          // the sending job ended
	// The sender's last state, stamped by the kernel's clock: lastSent ago as of the call at the given moment.
	stamp := func(ago time.Duration) uint64 {
		var mono unix.Timespec
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &mono); err != nil {
			t.Fatal(err)
		}
		return uint64(mono.Nano() - ago.Nanoseconds())
	}
	const lastSent = 2 * time.Hour
	failed := time.Now().Add(lastSent) // the receiver fails two hours after the flow's last segment
	src.states[connA] = ebpfprobes.FlowState{SndNxt: isn + 300_001, FinSent: true, KtimeNs: stamp(lastSent)}
	n.releaseFinished(context.Background(), n.Log(), failed)
	if st := n.Log().Stats(); st.RetainedBytes == 0 {
		t.Fatal("a finished flow's log went the moment its receiver failed: the restore that follows needs it")
	}
	if c := n.Conns(); len(c) != 1 || c[0].Release != "orphan" {
		t.Fatalf("conns %+v, want connA kept as an orphan", c)
	}
	later := failed.Add(release.OrphanKeep + time.Minute)
	src.states[connA] = ebpfprobes.FlowState{SndNxt: isn + 300_001, FinSent: true, KtimeNs: stamp(time.Until(later))}
	n.releaseFinished(context.Background(), n.Log(), later)
	if st := n.Log().Stats(); st.RetainedBytes != 0 {
		t.Errorf("%s after its receiver failed, the log retains %d bytes of an orphaned flow", release.OrphanKeep+time.Minute, st.RetainedBytes)
	}
}

// TestPausedConsumerIsAtCap: the capture's consumer pauses one append's worst case (two slabs and a
// segment) short of the cap, so the log's memory never reaches the cap while the jobs' segments are held
// back. The controller must take the consumer's pause for the cap: repeat an unanswered snapshot request
// after PausedRetry (2 s), not the 30 s cooldown (TCP gives up on held-back connections within seconds),
// and ask even if the memory is below the high watermark (log.high = 1, allowed, is above where the
// consumer stops). Before, it saw a log below its cap, never paused, asked again only after 30 s, and with
// a high watermark above the pause point never asked at all: the jobs stayed held back until the next
// scheduled snapshots.
func TestPausedConsumerIsAtCap(t *testing.T) {
	for _, tc := range []struct {
		name string
		high float64
		// requests wanted: above the high watermark, consumer running; then 2.5 s later, consumer paused
		first, then int
	}{
		{"above high: retried after PausedRetry", 0.8, 1, 2},
		{"high watermark at the cap: asked when the consumer pauses", 1, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &fakeMembers{owner: "n2"}
			n, src, _ := newTestNode(t, 300_000, m)
			live := n.Log().Stats().LiveBytes()
			var err error
			// The memory sits where the consumer stops, short of the cap.
			if n.ctl, err = controller.New(controller.Config{Cap: live + live/8, High: tc.high, Low: 0.5}); err != nil {
				t.Fatal(err)
			}
			requests := func() (asked int, paused bool) {
				for _, e := range n.Status().Events {
					switch e.Kind {
					case controller.EventRequest:
						asked++
					case controller.EventPause:
						paused = true
					}
				}
				return asked, paused
			}
			t0 := time.Now()
			n.step(context.Background(), t0)
			if asked, _ := requests(); asked != tc.first {
				t.Fatalf("consumer running, memory %d of %d: %d snapshot requests, want %d", live, n.CapBytes(), asked, tc.first)
			}
			src.counters.ConsumerPaused = true // the consumer holds back at the cap
			n.step(context.Background(), t0.Add(2500*time.Millisecond))
			if asked, paused := requests(); asked != tc.then || !paused {
				t.Errorf("consumer paused at the cap, memory %d of %d: %d snapshot requests (want %d), controller paused %v (want true)",
					live, n.CapBytes(), asked, tc.then, paused)
			}
		})
	}
}

// TestRangeAfterReleaseOfFinishedFlow: once a connection the sender finished (its FIN sent) is freed
// because its receiver's restore point passed its last segment, a restore of the receiver starts from a
// snapshot that holds every byte and the FIN. The range from there (one past the data's end) has nothing
// to replay, which the live state shows; before, it was refused as a connection not in the log, and with
// it the receiver's recovery, which only needs the live state.
func TestRangeAfterReleaseOfFinishedFlow(t *testing.T) {
	now := time.Now().Add(10 * time.Second) // past the release margin of the last segment
	m := &fakeMembers{owner: "n2", mark: release.Watermark{At: now, Addrs: []netip.Addr{connA.Remote.Addr()}}}
	n, src, payload := newTestNode(t, 5000, m)
	var mono unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &mono); err != nil {
		t.Fatal(err)
	}
	// The FIN left as the payload was logged: now by the kernel's clock, 10 s before the test's now.
	fin := ebpfprobes.FlowState{SndNxt: isn + uint32(len(payload)) + 1, FinSent: true, HasAck: true, KtimeNs: uint64(mono.Nano() - (10 * time.Second).Nanoseconds())}
	src.states[connA] = fin
	ctx := context.Background()
	n.releaseFinished(ctx, n.Log(), now)
	deadline := time.Now().Add(10 * time.Second) // a failure bound: the question runs in the background
	for n.ReleasedSoFar().Conns == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the finished connection was never freed: %+v", n.Conns())
		}
		time.Sleep(5 * time.Millisecond)
		n.releaseFinished(ctx, n.Log(), now)
	}
	r, err := n.Range(ctx, "n2", connA, fin.SndNxt)
	if err != nil {
		t.Fatalf("Range from the FIN's end of a freed finished connection: %v; want no bytes and the live state", err)
	}
	if r.Len != 0 || r.Live == nil || r.Live.SndNxt != fin.SndNxt {
		t.Errorf("Range: %d bytes, live %+v; want none and the live state", r.Len, r.Live)
	}
	// A receiver restored from before the last bytes needs them: still refused, by name.
	if _, err := n.Range(ctx, "n2", connA, isn+4000); !errors.Is(err, netlog.ErrUnknownConn) {
		t.Errorf("Range of freed bytes: %v; want %v", err, netlog.ErrUnknownConn)
	}
}
