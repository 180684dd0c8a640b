//go:build linux

package ebpfprobes

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/internal/tcpframe"
	"github.com/ftkit/ftkit/tcpflow"
)

func TestFlowStateHelpers(t *testing.T) {
	tests := []struct {
		name        string
		s           FlowState
		wantEnd     uint32
		wantPayload uint32
		wantOK      bool
	}{
		{"no SYN seen", FlowState{SndNxt: 5000}, 5000, 0, false},
		{"SYN only", FlowState{SndNxt: 1001, ISN: 1000, HasISN: true}, 1001, 0, true},
		{"data", FlowState{SndNxt: 1101, ISN: 1000, HasISN: true}, 1101, 100, true},
		{"data and FIN", FlowState{SndNxt: 1102, ISN: 1000, HasISN: true, FinSent: true}, 1101, 100, true},
		// The stream crossed 2^32: 0xffffff00 + 1 + 0x200 wraps to 0x101.
		{"across the wrap", FlowState{SndNxt: 0x101, ISN: 0xffffff00, HasISN: true}, 0x101, 0x200, true},
		{"FIN right after the wrap", FlowState{SndNxt: 0, ISN: 0xfffffff0, HasISN: true, FinSent: true}, 0xffffffff, 14, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.s.DataEnd(); got != tc.wantEnd {
				t.Errorf("DataEnd() = %#x, want %#x", got, tc.wantEnd)
			}
			n, ok := tc.s.PayloadSent()
			if n != tc.wantPayload || ok != tc.wantOK {
				t.Errorf("PayloadSent() = %d, %v; want %d, %v", n, ok, tc.wantPayload, tc.wantOK)
			}
		})
	}

	tsTests := []struct {
		tsecr   uint32
		elapsed time.Duration
		want    uint32
	}{
		{1000, 0, 1000},
		{1000, time.Microsecond, 1002},                 // 1 ms rounded up, then to even
		{1000, 2 * time.Millisecond, 1002},             // exact
		{1001, 0, 1002},                                // odd would mean microsecond timestamps
		{1001, 1500 * time.Microsecond, 1004},          // 1001 + 2 = 1003 -> 1004
		{0xffffffff, 0, 0},                             // wraps like TSvals do
		{0xfffffff0, 20 * time.Millisecond, 4},         // 0xfffffff0 + 20 = 4 after the wrap
		{77, -time.Second, 78},                         // a clock step back adds nothing
		{500, 10*time.Second + time.Nanosecond, 10502}, // 10001 ms
	}
	for _, tc := range tsTests {
		s := FlowState{TSecr: tc.tsecr, HasTS: true}
		if got := s.MinRestoredTimestamp(tc.elapsed); got != tc.want {
			t.Errorf("TSecr %d, elapsed %v: MinRestoredTimestamp = %d, want %d", tc.tsecr, tc.elapsed, got, tc.want)
		}
	}

	f := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.250.7.1:40000"), Remote: netip.MustParseAddrPort("192.168.0.254:5001")}
	k, err := flowKey(f)
	if err != nil {
		t.Fatal(err)
	}
	if got := flowFromKey(k); got != f {
		t.Errorf("flowFromKey(flowKey(%v)) = %v", f, got)
	}
}

// Verdicts as the test run returns them (tcx_action_base).
const (
	verdictNext = 0xffffffff // TCX_NEXT (-1)
	verdictDrop = 2          // TCX_DROP
)

// tsOpt is Linux's layout on established segments: NOP, NOP, timestamp.
func tsOpt(tsval, tsecr uint32) []byte {
	return append([]byte{1, 1}, tsBytes(tsval, tsecr)...)
}

// tsBytes is the 10-byte timestamp option.
func tsBytes(tsval, tsecr uint32) []byte {
	b := []byte{8, 10}
	b = binary.BigEndian.AppendUint32(b, tsval)
	return binary.BigEndian.AppendUint32(b, tsecr)
}

// synOpts is Linux's SYN layout: MSS, SACK permitted, timestamp, NOP, window scale.
func synOpts(tsval uint32) []byte {
	b := []byte{2, 4, 0x05, 0xb4, 4, 2}
	b = append(b, tsBytes(tsval, 0)...)
	return append(b, 1, 3, 3, 7)
}

func newTestLogger(t testing.TB, ring int) *TCPLogger {
	t.Helper()
	requirePrivileges(t)
	l, err := NewTCPLogger(TCPLoggerOptions{RingBufferSize: ring})
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("SKIPPED: this kernel cannot load the TCX logger: %v", err)
	}
	if err != nil {
		t.Fatalf("NewTCPLogger: %+v", err)
	}
	t.Cleanup(func() {
		if err := l.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return l
}

// run feeds seg to the program as a frame of flow f and returns its verdict.
func run(t testing.TB, l *TCPLogger, f tcpflow.Tuple, seg tcpframe.Segment) uint32 {
	t.Helper()
	ret, err := l.objs.Program.Run(&ebpf.RunOptions{Data: seg.Frame(f)})
	if err != nil {
		t.Fatalf("BPF_PROG_TEST_RUN: %v", err)
	}
	return ret
}

// TestFlowStateProgram runs the real program (BPF_PROG_TEST_RUN) on crafted
// segments of one protected flow and checks the state after each: the
// wrap-safe snd_nxt maximum across 2^32 (which a unit test of C code could
// not reach), ACK and window tracking, the option walk, sticky FIN/RST and
// the reset on a new SYN.
func TestFlowStateProgram(t *testing.T) {
	l := newTestLogger(t, 1<<20)
	if info, err := l.objs.Program.Info(); err == nil {
		n, _ := info.VerifiedInstructions()
		t.Logf("verifier processed %d instructions", n)
	}
	f := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.1:40000"), Remote: netip.MustParseAddrPort("10.9.0.2:5001")}
	if err := l.ProtectFlow(f); err != nil {
		t.Fatal(err)
	}

	const isn = 0xffffff00 // the stream crosses 2^32 after 0xff bytes
	const ack, win = 7777, 502
	steps := []struct {
		name string
		seg  tcpframe.Segment
		want FlowState // Segments and KtimeNs are checked apart
	}{
		{"SYN", tcpframe.Segment{Seq: isn, Flags: TCPFlagSYN, Window: 64240, Opts: synOpts(100)},
			FlowState{SndNxt: isn + 1, HasTS: true, TSval: 100, Window: 64240, Flags: TCPFlagSYN, ISN: isn, HasISN: true}},
		{"pure ACK", tcpframe.Segment{Seq: isn + 1, Ack: ack, Flags: TCPFlagACK, Window: win, Opts: tsOpt(101, 5000)},
			FlowState{SndNxt: isn + 1, Ack: ack, HasAck: true, HasTS: true, TSval: 101, TSecr: 5000, Window: win, Flags: TCPFlagACK, ISN: isn, HasISN: true}},
		{"data below the wrap", tcpframe.Segment{Seq: isn + 1, Ack: ack, Flags: TCPFlagACK, Window: win, Opts: tsOpt(102, 5000), Payload: 0x80},
			FlowState{SndNxt: 0xffffff81, Ack: ack, HasAck: true, HasTS: true, TSval: 102, TSecr: 5000, Window: win, Flags: TCPFlagACK, ISN: isn, HasISN: true}},
		// An unsigned max would stay at 0xffffff81.
		{"data across the wrap", tcpframe.Segment{Seq: 0xffffff81, Ack: ack + 10, Flags: TCPFlagACK | TCPFlagPSH, Window: win, Opts: tsOpt(103, 5001), Payload: 0x180},
			FlowState{SndNxt: 0x101, Ack: ack + 10, HasAck: true, HasTS: true, TSval: 103, TSecr: 5001, Window: win, Flags: TCPFlagACK | TCPFlagPSH, ISN: isn, HasISN: true}},
		// An unsigned max would jump back to 0xffffff81.
		{"retransmission from before the wrap", tcpframe.Segment{Seq: isn + 1, Ack: ack + 20, Flags: TCPFlagACK, Window: win + 1, Opts: tsOpt(104, 5002), Payload: 0x80},
			FlowState{SndNxt: 0x101, Ack: ack + 20, HasAck: true, HasTS: true, TSval: 104, TSecr: 5002, Window: win + 1, Flags: TCPFlagACK, ISN: isn, HasISN: true}},
		{"data after the wrap", tcpframe.Segment{Seq: 0x101, Ack: ack + 20, Flags: TCPFlagACK, Window: win, Opts: tsOpt(105, 5003), Payload: 100},
			FlowState{SndNxt: 0x165, Ack: ack + 20, HasAck: true, HasTS: true, TSval: 105, TSecr: 5003, Window: win, Flags: TCPFlagACK, ISN: isn, HasISN: true}},
		{"ACK without options keeps the last timestamps", tcpframe.Segment{Seq: 0x165, Ack: ack + 30, Flags: TCPFlagACK, Window: win},
			FlowState{SndNxt: 0x165, Ack: ack + 30, HasAck: true, HasTS: true, TSval: 105, TSecr: 5003, Window: win, Flags: TCPFlagACK, ISN: isn, HasISN: true}},
		{"timestamp at an odd offset", tcpframe.Segment{Seq: 0x165, Ack: ack + 30, Flags: TCPFlagACK, Window: win, Opts: append(append([]byte{1}, tsBytes(200, 6000)...), 0)},
			FlowState{SndNxt: 0x165, Ack: ack + 30, HasAck: true, HasTS: true, TSval: 200, TSecr: 6000, Window: win, Flags: TCPFlagACK, ISN: isn, HasISN: true}},
		{"timestamp after EOL is not seen", tcpframe.Segment{Seq: 0x165, Ack: ack + 30, Flags: TCPFlagACK, Window: win, Opts: append([]byte{0, 0, 1, 1}, tsOpt(300, 7000)...)},
			FlowState{SndNxt: 0x165, Ack: ack + 30, HasAck: true, HasTS: true, TSval: 200, TSecr: 6000, Window: win, Flags: TCPFlagACK, ISN: isn, HasISN: true}},
		{"timestamp after a malformed option is not seen", tcpframe.Segment{Seq: 0x165, Ack: ack + 30, Flags: TCPFlagACK, Window: win, Opts: append([]byte{3, 1, 1, 1}, tsOpt(301, 7001)...)},
			FlowState{SndNxt: 0x165, Ack: ack + 30, HasAck: true, HasTS: true, TSval: 200, TSecr: 6000, Window: win, Flags: TCPFlagACK, ISN: isn, HasISN: true}},
		{"truncated timestamp is not seen", tcpframe.Segment{Seq: 0x165, Ack: ack + 30, Flags: TCPFlagACK, Window: win, Opts: []byte{1, 1, 1, 1, 1, 1, 1, 1, 8, 10, 0, 0}},
			FlowState{SndNxt: 0x165, Ack: ack + 30, HasAck: true, HasTS: true, TSval: 200, TSecr: 6000, Window: win, Flags: TCPFlagACK, ISN: isn, HasISN: true}},
		{"wrong-size timestamp is skipped, the next one found", tcpframe.Segment{Seq: 0x165, Ack: ack + 30, Flags: TCPFlagACK, Window: win, Opts: append(append([]byte{8, 6, 9, 9, 9, 9}, tsOpt(400, 8000)...), 0, 0)},
			FlowState{SndNxt: 0x165, Ack: ack + 30, HasAck: true, HasTS: true, TSval: 400, TSecr: 8000, Window: win, Flags: TCPFlagACK, ISN: isn, HasISN: true}},
		{"FIN", tcpframe.Segment{Seq: 0x165, Ack: ack + 30, Flags: TCPFlagFIN | TCPFlagACK, Window: win, Opts: tsOpt(401, 8000)},
			FlowState{SndNxt: 0x166, Ack: ack + 30, HasAck: true, HasTS: true, TSval: 401, TSecr: 8000, Window: win, Flags: TCPFlagFIN | TCPFlagACK, ISN: isn, HasISN: true, FinSent: true}},
		{"ACK after FIN keeps FinSent", tcpframe.Segment{Seq: 0x166, Ack: ack + 31, Flags: TCPFlagACK, Window: win, Opts: tsOpt(402, 8001)},
			FlowState{SndNxt: 0x166, Ack: ack + 31, HasAck: true, HasTS: true, TSval: 402, TSecr: 8001, Window: win, Flags: TCPFlagACK, ISN: isn, HasISN: true, FinSent: true}},
		{"RST does not move snd_nxt", tcpframe.Segment{Seq: 0x9999, Flags: TCPFlagRST},
			FlowState{SndNxt: 0x166, Ack: ack + 31, HasAck: true, HasTS: true, TSval: 402, TSecr: 8001, Flags: TCPFlagRST, ISN: isn, HasISN: true, FinSent: true, RstSent: true}},
		{"new SYN on the 4-tuple restarts the state", tcpframe.Segment{Seq: 0x1000, Flags: TCPFlagSYN, Window: 64240, Opts: synOpts(900)},
			FlowState{SndNxt: 0x1001, HasTS: true, TSval: 900, Window: 64240, Flags: TCPFlagSYN, ISN: 0x1000, HasISN: true}},
	}
	var prev FlowState
	for i, st := range steps {
		if v := run(t, l, f, st.seg); v != verdictNext {
			t.Fatalf("step %q: verdict %#x, want TCX_NEXT", st.name, v)
		}
		got, ok, err := l.FlowState(f)
		if err != nil || !ok {
			t.Fatalf("step %q: FlowState: %v, %v", st.name, ok, err)
		}
		wantSegs := prev.Segments + 1
		if i == 0 || st.seg.Flags&TCPFlagSYN != 0 {
			wantSegs = 1
		}
		if got.Segments != wantSegs || got.KtimeNs < prev.KtimeNs || got.KtimeNs == 0 {
			t.Errorf("step %q: Segments %d (want %d), KtimeNs %d (previous %d)", st.name, got.Segments, wantSegs, got.KtimeNs, prev.KtimeNs)
		}
		prev = got
		got.Segments, got.KtimeNs = 0, 0
		if got != st.want {
			t.Errorf("step %q:\n got %+v\nwant %+v", st.name, got, st.want)
		}
	}
	if age, err := prev.Age(); err != nil || age < 0 || age > time.Minute {
		t.Errorf("Age() = %v, %v", age, err)
	}

	// A retransmitted SYN (same ISN) is an ordinary update.
	run(t, l, f, tcpframe.Segment{Seq: 0x1000, Flags: TCPFlagSYN, Window: 64240, Opts: synOpts(901)})
	if got, _, _ := l.FlowState(f); got.Segments != 2 || got.TSval != 901 || got.ISN != 0x1000 {
		t.Errorf("after a retransmitted SYN: %+v", got)
	}

	// Unprotected flows, including the reverse of f, get no state.
	other := tcpflow.Tuple{Local: f.Remote, Remote: f.Local}
	run(t, l, other, tcpframe.Segment{Seq: 1, Ack: 2, Flags: TCPFlagACK, Opts: tsOpt(1, 2), Payload: 10})
	if _, ok, err := l.FlowState(other); ok || err != nil {
		t.Errorf("unprotected flow has a state (%v, %v)", ok, err)
	}
	all, err := l.FlowStates()
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 1 || all[f].ISN != 0x1000 {
		t.Errorf("FlowStates() = %+v, want only %v", all, f)
	}
	if _, _, err := l.FlowState(tcpflow.Tuple{Local: netip.MustParseAddrPort("[::1]:1"), Remote: netip.MustParseAddrPort("[::1]:2")}); err == nil {
		t.Error("FlowState of an IPv6 flow: no error")
	}
}

// TestFlowStateIgnoresDroppedSegments: a segment dropped for backpressure
// was never transmitted, so it must not raise snd_nxt (the restorer would
// inject bytes that are not in the log).
func TestFlowStateIgnoresDroppedSegments(t *testing.T) {
	page := os.Getpagesize()
	l := newTestLogger(t, page) // the smallest ring: a few 1000-byte records fill it
	f := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.1:40001"), Remote: netip.MustParseAddrPort("10.9.0.2:5001")}
	if err := l.ProtectFlow(f); err != nil {
		t.Fatal(err)
	}
	seq := uint32(1000)
	var logged, dropped int
	for range page / 1000 * 2 {
		before, _, _ := l.FlowState(f)
		v := run(t, l, f, tcpframe.Segment{Seq: seq, Ack: 1, Flags: TCPFlagACK, Opts: tsOpt(seq, 1), Payload: 1000})
		after, ok, err := l.FlowState(f)
		if err != nil {
			t.Fatal(err)
		}
		switch v {
		case verdictNext:
			logged++
			if !ok || after.SndNxt != seq+1000 {
				t.Fatalf("logged segment [%d, %d): state %+v", seq, seq+1000, after)
			}
			seq += 1000
		case verdictDrop:
			dropped++
			if after != before {
				t.Fatalf("dropped segment [%d, %d) changed the state: %+v -> %+v", seq, seq+1000, before, after)
			}
		default:
			t.Fatalf("verdict %#x", v)
		}
	}
	c, err := l.Counters()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d segments logged, %d dropped; counters %+v", logged, dropped, c)
	if logged == 0 || dropped == 0 || c.DropsBackpressure != uint64(dropped) {
		t.Errorf("want both logged and dropped segments: %d logged, %d dropped, counters %+v", logged, dropped, c)
	}
}

// refTimestamp is the reference for the program's option walk: the kernel's
// tcp_parse_options, stopping at the first well-formed timestamp option.
func refTimestamp(opts []byte) (tsval, tsecr uint32, ok bool) {
	for i := 0; i < len(opts); {
		switch opts[i] {
		case 0:
			return 0, 0, false
		case 1:
			i++
			continue
		}
		if i+1 >= len(opts) {
			return 0, 0, false
		}
		n := int(opts[i+1])
		if n < 2 || i+n > len(opts) {
			return 0, 0, false
		}
		if opts[i] == 8 && n == 10 {
			return binary.BigEndian.Uint32(opts[i+2:]), binary.BigEndian.Uint32(opts[i+6:]), true
		}
		i += n
	}
	return 0, 0, false
}

// FuzzTimestampOption compares the program's TCP option walk (run for real
// with BPF_PROG_TEST_RUN) with refTimestamp. Each input is a SYN with a new
// ISN, which restarts the flow's state, so that no earlier timestamp leaks in.
func FuzzTimestampOption(f *testing.F) {
	f.Add(synOpts(1))
	f.Add(tsOpt(1, 2))
	f.Add([]byte{1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2, 0})
	f.Add([]byte{8, 6, 1, 1, 1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2})
	f.Add([]byte{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2})
	f.Add([]byte{2, 0, 8, 10})
	l := newTestLogger(f, 1<<20)
	flow := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.1:40002"), Remote: netip.MustParseAddrPort("10.9.0.2:5001")}
	if err := l.ProtectFlow(flow); err != nil {
		f.Fatal(err)
	}
	var isn uint32
	f.Fuzz(func(t *testing.T, opts []byte) {
		opts = opts[:min(len(opts), 40)&^3] // doff counts 4-byte words
		isn++
		if v := run(t, l, flow, tcpframe.Segment{Seq: isn, Flags: TCPFlagSYN, Opts: opts}); v != verdictNext {
			t.Fatalf("verdict %#x", v)
		}
		got, ok, err := l.FlowState(flow)
		if err != nil || !ok || got.ISN != isn {
			t.Fatalf("FlowState: %+v, %v, %v", got, ok, err)
		}
		tsval, tsecr, has := refTimestamp(opts)
		if got.HasTS != has || got.TSval != tsval || got.TSecr != tsecr {
			t.Errorf("options %x: program says HasTS %v TSval %d TSecr %d; want %v %d %d",
				opts, got.HasTS, got.TSval, got.TSecr, has, tsval, tsecr)
		}
	})
}

// TestFlowStateEndToEnd runs a real connection between two lab hosts with
// the logger on both hosts' eth0: A sends N bytes in two phases with varied
// writes, B only reads (its flow is pure ACKs). It checks the states of A->B
// and B->A against the ISN from the SYN, the first logged record, and the
// byte counts, then that FIN is recorded and the state kept.
//
// The close runs both ways the kernel may order it. A closes first (close(),
// the socket is orphaned); B's FIN comes when its process exits. If B's ACK
// of A's FIN rides on B's FIN, A is still a full socket when it answers, and
// its last ACK is logged under A's cgroup. If B acks A's FIN on its own first
// (its delayed-ACK timer fires before the process exits: what a loaded
// machine does, forced here with a quickack route on B), A's orphan becomes a
// TIME_WAIT socket, and the kernel sends the ACK of B's FIN from that
// mini-socket: no full socket, bpf_skb_cgroup_id is 0, so the segment is not
// attributed to the protected cgroup and A's state keeps the ACK number of
// its FIN (see "Which flows are protected" in bpf/tcplog.c). A test that
// waits for that last ACK in A's state waits forever on a loaded machine.
func TestFlowStateEndToEnd(t *testing.T) {
	requirePrivileges(t)
	for i, tc := range []struct {
		name string
		// quickack: B acks every segment at once, so it acks A's FIN
		// before its process exits and sends its own FIN.
		quickack bool
	}{
		{"FIN and ACK of FIN as the kernel times them", false},
		{"B acks the FIN before it closes", true},
	} {
		t.Run(tc.name, func(t *testing.T) { flowStateEndToEnd(t, uint16(5101+i), tc.quickack) })
	}
}

func flowStateEndToEnd(t *testing.T, port uint16, quickack bool) {
	// A failure bound only: the run takes about a second on an idle machine.
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	tn := newTestNet(t)
	cg := streamtest.NewCgroupT(t, "flowstate")
	l := newTestLogger(t, 16<<20)
	if err := l.Protect(cg.ID); err != nil {
		t.Fatal(err)
	}
	if err := tn.attach(l, hostA); err != nil {
		t.Fatalf("Attach in a: %v", err)
	}
	if err := tn.attach(l, hostB); err != nil {
		t.Fatalf("Attach in b: %v", err)
	}
	if quickack {
		if err := tn.quickack(hostB); err != nil {
			t.Fatal(err)
		}
	}

	const seed = 42
	phases := []int{3<<20 + 12345, 1<<20 + 777}
	total := phases[0] + phases[1]
	recv := streamtest.StartT(t, tn.lab, hostB, cg, "recv", fmt.Sprintf("FTKIT_ADDR=%s:%d", tn.ipB, port))
	if got := recv.LineT(ctx, t); got != "ready" {
		t.Fatalf("receiver said %q", got)
	}
	col := collect(ctx, l, 0)
	send := streamtest.StartT(t, tn.lab, hostA, cg, "sendwait",
		fmt.Sprintf("FTKIT_ADDR=%s:%d", tn.ipB, port), fmt.Sprintf("FTKIT_SEED=%d", seed),
		fmt.Sprintf("FTKIT_SIZES=%d,%d", phases[0], phases[1]))
	var sport uint16
	if _, err := fmt.Sscanf(send.LineT(ctx, t), "port %d", &sport); err != nil {
		t.Fatal(err)
	}
	ab := tcpflow.Tuple{Local: netip.AddrPortFrom(tn.ipA, sport), Remote: netip.AddrPortFrom(tn.ipB, port)}
	ba := tcpflow.Tuple{Local: ab.Remote, Remote: ab.Local}

	// settle waits until cond holds for both states and they stayed
	// unchanged for 100 ms (a quiet period), and returns them.
	settle := func(what string, cond func(a, b FlowState) bool) (FlowState, FlowState) {
		t.Helper()
		var a, b, lastA, lastB FlowState
		stableSince := time.Now()
		for {
			var okA, okB bool
			var err error
			if a, okA, err = l.FlowState(ab); err != nil {
				t.Fatal(err)
			}
			if b, okB, err = l.FlowState(ba); err != nil {
				t.Fatal(err)
			}
			if a != lastA || b != lastB {
				lastA, lastB, stableSince = a, b, time.Now()
			}
			if okA && okB && cond(a, b) && time.Since(stableSince) >= 100*time.Millisecond {
				return a, b
			}
			select {
			case <-ctx.Done():
				t.Fatalf("%s: not reached; last states\nA->B %+v\nB->A %+v", what, a, b)
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	sent := func(n int) func(a, b FlowState) bool {
		return func(a, b FlowState) bool {
			p, _ := a.PayloadSent()
			return p == uint32(n) && b.Ack == a.SndNxt
		}
	}

	var samples [2][2]FlowState // [phase][A->B, B->A]
	for i, n := range []int{phases[0], total} {
		if got := send.LineT(ctx, t); got != fmt.Sprintf("sent %d", n) {
			t.Fatalf("sender said %q", got)
		}
		a, b := settle(fmt.Sprintf("phase %d: %d bytes sent and acked", i+1, n), sent(n))
		samples[i] = [2]FlowState{a, b}
		t.Logf("phase %d: A->B %+v", i+1, a)
		t.Logf("phase %d: B->A %+v", i+1, b)
		// A's state: SYN seen, exactly n payload bytes, timestamps on.
		if !a.HasISN || !a.HasTS || !a.HasAck || a.FinSent || a.RstSent {
			t.Errorf("phase %d: A->B %+v: want ISN, TS and ACK seen, no FIN/RST", i+1, a)
		}
		if a.SndNxt-a.ISN-1 != uint32(n) {
			t.Errorf("phase %d: A's SndNxt - ISN - 1 = %d, want %d", i+1, a.SndNxt-a.ISN-1, n)
		}
		// B never wrote: its snd_nxt is its ISN + 1 (the SYN-ACK), it acked all of A.
		if !b.HasISN || !b.HasTS || b.SndNxt != b.ISN+1 || b.Ack != a.SndNxt || a.Ack != b.SndNxt {
			t.Errorf("phase %d: B->A %+v does not match a pure-ACK flow that acked A->B %+v", i+1, b, a)
		}
		// Each side echoes a TSval the other has sent: never ahead of it.
		if int32(b.TSval-a.TSecr) < 0 || int32(a.TSval-b.TSecr) < 0 {
			t.Errorf("phase %d: an echo is ahead of the clock it echoes: A TSval %d TSecr %d, B TSval %d TSecr %d",
				i+1, a.TSval, a.TSecr, b.TSval, b.TSecr)
		}
		if b.Window == 0 {
			t.Errorf("phase %d: B advertises a zero window after reading everything", i+1)
		}
		if i == 0 {
			time.Sleep(20 * time.Millisecond) // the TS clocks tick in ms: make them move
			if _, err := fmt.Fprintln(send.Stdin, "go"); err != nil {
				t.Fatal(err)
			}
		}
	}
	a1, b1, a2, b2 := samples[0][0], samples[0][1], samples[1][0], samples[1][1]
	if a2.ISN != a1.ISN || b2.ISN != b1.ISN {
		t.Errorf("ISNs changed between samples: A %d -> %d, B %d -> %d", a1.ISN, a2.ISN, b1.ISN, b2.ISN)
	}
	if int32(a2.TSval-a1.TSval) <= 0 || int32(b2.TSval-b1.TSval) <= 0 {
		t.Errorf("TSvals did not increase: A %d -> %d, B %d -> %d", a1.TSval, a2.TSval, b1.TSval, b2.TSval)
	}
	if b2.Ack-b1.Ack != uint32(phases[1]) || b2.Segments <= b1.Segments {
		t.Errorf("B's pure-ACK flow: Ack advanced %d (want %d), segments %d -> %d",
			b2.Ack-b1.Ack, phases[1], b1.Segments, b2.Segments)
	}

	// Close: A's FIN takes one sequence number; the state stays.
	if _, err := fmt.Fprintln(send.Stdin, "go"); err != nil {
		t.Fatal(err)
	}
	if got := send.LineT(ctx, t); got != "closed" {
		t.Fatalf("sender said %q", got)
	}
	if got, want := recv.LineT(ctx, t), fmt.Sprintf("%d ", total); len(got) < len(want) || got[:len(want)] != want {
		t.Fatalf("receiver got %q, want %d bytes", got, total)
	}
	// What is sure to be seen: both FINs (each from a full socket) and B's
	// ACK of A's FIN. A's ACK of B's FIN is seen only if A sent it from its
	// full socket; from TIME_WAIT it is not attributed (see above).
	a, b := settle("both FINs sent, A's FIN acked", func(a, b FlowState) bool {
		return a.FinSent && b.FinSent && b.Ack == a.SndNxt && (a.Ack == b.SndNxt || a.Ack+1 == b.SndNxt)
	})
	t.Logf("closed: A->B %+v", a)
	t.Logf("closed: B->A %+v", b)
	if a.SndNxt != a2.SndNxt+1 || a.DataEnd() != a2.SndNxt || b.SndNxt != b.ISN+2 {
		t.Errorf("after FIN: A SndNxt %d (data end %d), want %d; B SndNxt %d, want ISN+2 = %d",
			a.SndNxt, a.DataEnd(), a2.SndNxt+1, b.SndNxt, b.ISN+2)
	}
	if a.Ack == b.SndNxt {
		t.Log("A acked B's FIN from its full socket")
	} else {
		t.Log("A acked B's FIN from TIME_WAIT (not attributed to its cgroup)")
	}
	// The forced case really took the other path: B's ACK of A's FIN and B's
	// FIN are two segments.
	if quickack && b.Segments < b2.Segments+2 {
		t.Errorf("with quickack on B: %d segments from B after the data, want its ACK of A's FIN and its FIN apart", b.Segments-b2.Segments)
	}
	if p, ok := a.PayloadSent(); !ok || p != uint32(total) {
		t.Errorf("PayloadSent() = %d, %v; want %d", p, ok, total)
	}

	// The log agrees: its first record starts at ISN + 1, its bytes end at DataEnd.
	cancel()
	<-col.done
	if col.err != nil {
		t.Fatalf("reading records: %v", col.err)
	}
	recs := col.bySport[sport]
	data, _, err := reassemble(recs)
	if err != nil {
		t.Fatalf("A->B log: %v", err)
	}
	first, end := recs[0].seq, recs[0].seq
	for _, r := range recs {
		if int32(r.seq-first) < 0 {
			first = r.seq
		}
		if e := r.seq + uint32(len(r.payload)); int32(e-end) > 0 {
			end = e
		}
	}
	if first != a.ISN+1 || end != a.DataEnd() || len(data) != total {
		t.Errorf("log of A->B: bytes [%d, %d), %d bytes; want [%d, %d), %d bytes", first, end, len(data), a.ISN+1, a.DataEnd(), total)
	}
	if n := len(col.bySport[port]); n != 0 {
		t.Errorf("B sent no payload but %d records were logged for B->A", n)
	}
}

// quickack sets the quickack attribute on every route of host's eth0: the
// host's TCP then acks each segment at once instead of delaying the ACK.
func (tn *testNet) quickack(host string) error {
	return tn.lab.Do(host, func() error {
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return fmt.Errorf("find eth0 on %s: %w", host, err)
		}
		routes, err := netlink.RouteList(eth0, netlink.FAMILY_V4)
		if err != nil {
			return fmt.Errorf("list routes of eth0 on %s: %w", host, err)
		}
		if len(routes) == 0 {
			return fmt.Errorf("eth0 on %s has no IPv4 route", host)
		}
		for _, r := range routes {
			r.QuickACK = 1
			if err := netlink.RouteReplace(&r); err != nil {
				return fmt.Errorf("set quickack on route %s of %s: %w", r.Dst, host, err)
			}
		}
		return nil
	})
}

// TestFullRingPassesLoggedBytes runs the real program on crafted segments with its ring full: a segment
// whose bytes all have a record already (a retransmission) passes unlogged, one with a byte that has none
// is dropped and marks its flow stalled, and a flow whose entry did not start at its SYN gets no such
// pass, since nothing is known of its logged bytes. Each case is one that the old program dropped.
func TestFullRingPassesLoggedBytes(t *testing.T) {
	page := os.Getpagesize()
	l := newTestLogger(t, page) // the smallest ring: a few 1000-byte records fill it
	f := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.1:40002"), Remote: netip.MustParseAddrPort("10.9.0.2:5001")}
	if err := l.ProtectFlow(f); err != nil {
		t.Fatal(err)
	}
	const isn = 0xfffffc00 // the logged bytes cross the 2^32 wrap 1 KiB in
	seg := func(seq uint32, payload int) tcpframe.Segment {
		return tcpframe.Segment{Seq: seq, Ack: 1, Flags: TCPFlagACK, Opts: tsOpt(seq, 1), Payload: payload}
	}
	if v := run(t, l, f, tcpframe.Segment{Seq: isn, Flags: TCPFlagSYN, Opts: synOpts(1)}); v != verdictNext {
		t.Fatalf("SYN: verdict %#x", v)
	}
	// Log until the ring has no room for another record, not even of one byte.
	next := uint32(isn + 1)
	for _, size := range []int{1000, 1} {
		for {
			v := run(t, l, f, seg(next, size))
			if v == verdictDrop {
				break
			}
			if v != verdictNext {
				t.Fatalf("verdict %#x", v)
			}
			next += uint32(size)
		}
	}
	if next-(isn+1) < 2000 {
		t.Fatalf("the ring took only %d bytes", next-(isn+1))
	}
	dropped := func() uint64 {
		c, err := l.Counters()
		if err != nil {
			t.Fatal(err)
		}
		return c.DropsBackpressure
	}
	for _, tc := range []struct {
		name string
		seq  uint32
		len  int
		want uint32
	}{
		{"the first logged bytes again", isn + 1, 1000, verdictNext},
		{"logged bytes, across the wrap", isn + 1 + 500, 1000, verdictNext},
		{"the last logged bytes", next - 500, 500, verdictNext},
		{"one byte past them", next - 500, 501, verdictDrop},
		{"new bytes", next, 1000, verdictDrop},
		{"before the first byte", isn - 1000, 1000, verdictDrop},
	} {
		before := dropped()
		if v := run(t, l, f, seg(tc.seq, tc.len)); v != tc.want {
			t.Errorf("%s [%d, +%d): verdict %#x, want %#x", tc.name, tc.seq, tc.len, v, tc.want)
		}
		if wantDrops := before + map[bool]uint64{true: 1}[tc.want == verdictDrop]; dropped() != wantDrops {
			t.Errorf("%s: %d drops, want %d", tc.name, dropped(), wantDrops)
		}
	}
	c, err := l.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.LoggedPassed != 3 {
		t.Errorf("%d segments passed unlogged, want 3 (counters %+v)", c.LoggedPassed, c)
	}
	var pending uint32
	if err := l.objs.StalledPending.Get(&pending); err != nil || pending != 1 {
		t.Errorf("stalled_pending %d (%v) after drops, want 1", pending, err)
	}
	var since uint64
	k, _ := flowKey(f)
	if err := l.objs.StalledFlows.Lookup(k, &since); err != nil || since == 0 {
		t.Errorf("the dropping flow is not in stalled_flows with the time of its first drop: %d, %v", since, err)
	}

	// A flow that has logged more than 2^31 bytes: serial arithmetic cannot tell its first byte from one
	// 2^31 before logged_next, so what counts is being within 2^31 bytes before logged_next. The entry is
	// written as the program leaves it after 3 GiB (logging them through the ring would take minutes).
	long := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.1:40004"), Remote: netip.MustParseAddrPort("10.9.0.2:5001")}
	if err := l.ProtectFlow(long); err != nil {
		t.Fatal(err)
	}
	lk, _ := flowKey(long)
	const longISN, logged3G = 1000, 3 << 30
	if err := l.objs.FlowStates.Put(lk, tcplogFlowState{SndNxt: longISN + 1 + logged3G, Isn: longISN, Seen: seenSYN | seenLogged | seenLong,
		LoggedNext: longISN + 1 + logged3G}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		seq  uint32
		want uint32
	}{
		{"the last logged bytes", longISN + 1 + logged3G - 1000, verdictNext},
		{"logged bytes 1 GiB back", longISN + 1 + logged3G - 1<<30, verdictNext},
		{"new bytes", longISN + 1 + logged3G, verdictDrop},
	} {
		if v := run(t, l, long, seg(tc.seq, 1000)); v != tc.want {
			t.Errorf("flow past 2^31 bytes, %s: verdict %#x, want %#x", tc.name, v, tc.want)
		}
	}

	// The program marks the prefix long when a logged segment takes it past 2^31 bytes.
	l2 := newTestLogger(t, page)
	if err := l2.ProtectFlow(long); err != nil {
		t.Fatal(err)
	}
	edge := uint32(longISN + 1 + 1<<31 - 500)
	if err := l2.objs.FlowStates.Put(lk, tcplogFlowState{SndNxt: edge, Isn: longISN, Seen: seenSYN | seenLogged, LoggedNext: edge}); err != nil {
		t.Fatal(err)
	}
	if v := run(t, l2, long, seg(edge, 1000)); v != verdictNext {
		t.Fatalf("the segment that takes the prefix past 2^31 bytes: verdict %#x", v)
	}
	var st tcplogFlowState
	if err := l2.objs.FlowStates.Lookup(lk, &st); err != nil {
		t.Fatal(err)
	}
	if st.LoggedNext != edge+1000 || st.Seen&seenLong == 0 {
		t.Errorf("after the prefix passed 2^31 bytes: logged_next %d (want %d), seen %#x (want the long bit)", st.LoggedNext, edge+1000, st.Seen)
	}

	// A flow first seen mid-stream (its SYN went by before it was protected, or its entry was evicted):
	// its logged bytes are unknown, so nothing passes unlogged.
	g := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.1:40003"), Remote: netip.MustParseAddrPort("10.9.0.2:5001")}
	if err := l.ProtectFlow(g); err != nil {
		t.Fatal(err)
	}
	if v := run(t, l, g, tcpframe.Segment{Seq: 5000, Ack: 1, Flags: TCPFlagACK, Opts: tsOpt(1, 1)}); v != verdictNext {
		t.Fatalf("pure ACK: verdict %#x", v)
	}
	if v := run(t, l, g, seg(4000, 1000)); v != verdictDrop {
		t.Errorf("bytes below the snd_nxt of a flow seen mid-stream: verdict %#x, want a drop", v)
	}
}
