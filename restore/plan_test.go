//go:build linux

package restore

import (
	"bytes"
	"errors"
	"math"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/tcpflow"
)

var (
	addrF = netip.MustParseAddrPort("10.0.0.11:40000")
	addrP = netip.MustParseAddrPort("10.0.0.12:7000")
)

// conn is a snapshot connection: receive point inq, write_seq outq with
// outqLen bytes unacknowledged, timestamp ts.
func conn(inode uint64, inq, outq, outqLen, ts uint32) ckpt.Conn {
	return ckpt.Conn{Tuple: tcpflow.Tuple{Local: addrF, Remote: addrP}, Inode: inode, InqSeq: inq, InqLen: 3, OutqSeq: outq, OutqLen: outqLen, Timestamp: ts}
}

// live is the peer's state: it sent up to sndNxt, acknowledged up to ack.
func live(sndNxt, ack, tsecr uint32) ebpfprobes.FlowState {
	return ebpfprobes.FlowState{SndNxt: sndNxt, Ack: ack, HasAck: true, TSecr: tsecr, HasTS: true}
}

// logged is n distinct bytes.
func logged(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*13 + 1)
	}
	return b
}

func TestPlanConn(t *testing.T) {
	const seg = 100
	withFIN := func(s ebpfprobes.FlowState) ebpfprobes.FlowState { s.FinSent = true; return s }
	tests := []struct {
		name       string
		c          ckpt.Conn
		p          Peer
		wantInject int
		wantResend uint32
		wantTS     uint32 // 0: no timestamp edit
		wantFin    bool   // the peer's FIN is delivered after the restore
		wantErr    string // substring; the error must wrap ErrNotRecoverable
	}{
		{
			name: "peer ahead both ways",
			c:    conn(1, 1000, 5000, 100, 2000),
			p:    Peer{Live: live(1100, 5200, 7000), LiveAge: 500 * time.Millisecond, Logged: logged(150)},
			// 100 bytes to inject; the peer has 200 bytes past write_seq;
			// TSecr 7000 + 500 ms + 1 s margin.
			wantInject: 100, wantResend: 200, wantTS: 8500,
		},
		{
			name:       "in step: nothing to add",
			c:          conn(1, 1000, 5000, 0, 2000),
			p:          Peer{Live: live(1000, 5000, 2000), Logged: nil},
			wantInject: 0, wantResend: 0, wantTS: 3000,
		},
		{
			name: "sequence numbers wrap",
			c:    conn(1, math.MaxUint32-49, math.MaxUint32-9, 20, 10),
			p:    Peer{Live: live(30, 15, 10), Logged: logged(80)},
			// inject 2^32-50 .. 30 = 80 bytes; resend 2^32-10 .. 15 = 25.
			wantInject: 80, wantResend: 25, wantTS: 1010,
		},
		{
			name:       "timestamp wraps, serial max with the image's",
			c:          conn(1, 1000, 5000, 0, math.MaxUint32-199),
			p:          Peer{Live: live(1000, 5000, math.MaxUint32-99), Logged: nil},
			wantInject: 0, wantResend: 0, wantTS: 900, // 2^32-100 + 1000, wrapped
		},
		{
			name:       "image timestamp ahead of the peer's echo is kept",
			c:          conn(1, 1000, 5000, 0, 50000),
			p:          Peer{Live: live(1000, 5000, 7000), Logged: nil},
			wantInject: 0, wantResend: 0, wantTS: 50000,
		},
		{
			name:       "odd result rounded up to even",
			c:          conn(1, 1000, 5000, 0, 2),
			p:          Peer{Live: live(1000, 5000, 7001), Logged: nil},
			wantInject: 0, wantTS: 8002,
		},
		{
			name:       "FIN from the peer: inject up to the data end, the FIN after the restore",
			c:          conn(1, 1000, 5000, 0, 2),
			p:          Peer{Live: withFIN(live(1041, 5000, 10)), Logged: logged(40)},
			wantInject: 40, wantTS: 1010, wantFin: true,
		},
		{
			name:       "FIN from the peer right after the snapshot's data",
			c:          conn(1, 1040, 5000, 0, 2),
			p:          Peer{Live: withFIN(live(1041, 5000, 10)), Logged: nil},
			wantInject: 0, wantTS: 1010, wantFin: true,
		},
		{
			name:       "FIN already in the snapshot",
			c:          conn(1, 1041, 5000, 0, 2),
			p:          Peer{Live: withFIN(live(1041, 5000, 10)), Logged: nil},
			wantInject: 0, wantTS: 1010,
		},
		{
			name:       "ack inside the out-queue: the restored socket retransmits, nothing re-sent",
			c:          conn(1, 1000, 5000, 300, 2),
			p:          Peer{Live: live(1000, 4800, 10), Logged: nil},
			wantInject: 0, wantResend: 0, wantTS: 1010,
		},
		{
			name:       "ack exactly at snd_una",
			c:          conn(1, 1000, 5000, 300, 2),
			p:          Peer{Live: live(1000, 4700, 10), Logged: nil},
			wantInject: 0, wantResend: 0, wantTS: 1010,
		},
		{
			name:       "no timestamps on the connection",
			c:          conn(1, 1000, 5000, 0, 0),
			p:          Peer{Live: ebpfprobes.FlowState{SndNxt: 1010, Ack: 5008, HasAck: true}, Logged: logged(10)},
			wantInject: 10, wantResend: 8,
		},
		{
			name:    "short log",
			c:       conn(1, 1000, 5000, 0, 2),
			p:       Peer{Live: live(1100, 5000, 10), Logged: logged(99)},
			wantErr: "sent 100 bytes after the snapshot's receive point (sequence 1000 to 1100) but its log holds only 99",
		},
		{
			name:    "RST",
			c:       conn(1, 1000, 5000, 0, 2),
			p:       Peer{Live: ebpfprobes.FlowState{SndNxt: 1000, Ack: 5000, HasAck: true, RstSent: true}},
			wantErr: "reset",
		},
		{
			name:    "no ack",
			c:       conn(1, 1000, 5000, 0, 2),
			p:       Peer{Live: ebpfprobes.FlowState{SndNxt: 1000}},
			wantErr: "no ACK",
		},
		{
			name:    "ack behind snd_una",
			c:       conn(1, 1000, 5000, 300, 2),
			p:       Peer{Live: live(1000, 4699, 10)},
			wantErr: "acknowledges up to sequence 4699, 1 bytes before",
		},
		{
			name:    "ack behind snd_una across the wrap",
			c:       conn(1, 1000, 100, 300, 2), // snd_una = 2^32-200
			p:       Peer{Live: live(1000, math.MaxUint32-300, 10)},
			wantErr: "101 bytes before",
		},
		{
			name:    "peer sent less than the snapshot received",
			c:       conn(1, 1000, 5000, 0, 2),
			p:       Peer{Live: live(990, 5000, 10)},
			wantErr: "10 bytes before the snapshot's receive point",
		},
		{
			name:    "microsecond timestamps",
			c:       conn(1, 1000, 5000, 0, 3),
			p:       Peer{Live: live(1000, 5000, 10)},
			wantErr: "microsecond",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cp, err := PlanConn(tt.c, tt.p, seg)
			if tt.wantErr != "" {
				if err == nil || !errors.Is(err, ErrNotRecoverable) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want ErrNotRecoverable containing %q", err, tt.wantErr)
				}
				if !strings.Contains(err.Error(), addrF.String()) {
					t.Errorf("error %q does not name the connection", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(cp.Inject, tt.p.Logged[:tt.wantInject]) {
				t.Errorf("inject %d bytes, want the first %d logged", len(cp.Inject), tt.wantInject)
			}
			if cp.Resend != tt.wantResend {
				t.Errorf("resend %d, want %d", cp.Resend, tt.wantResend)
			}
			if cp.Fin != tt.wantFin {
				t.Errorf("FIN to deliver %v, want %v", cp.Fin, tt.wantFin)
			}
			if cp.HasTimestamp != (tt.wantTS != 0) || cp.Timestamp != tt.wantTS {
				t.Errorf("timestamp %v %d, want %d", cp.HasTimestamp, cp.Timestamp, tt.wantTS)
			}
			if cp.Timestamp&1 != 0 {
				t.Errorf("timestamp %d is odd (would select microsecond timestamps)", cp.Timestamp)
			}
			// The burst is the out-queue plus the re-sent range.
			burst := int(tt.c.OutqLen) + int(tt.wantResend)
			if want := (burst+seg-1)/seg + CwndMargin; cp.Segments != want {
				t.Errorf("segments %d, want %d", cp.Segments, want)
			}
			if tt.wantResend == 0 {
				if cp.SndWnd != 0 || cp.MaxWindow != 0 || cp.SndBuf != 0 {
					t.Errorf("windows %d/%d, sndbuf %d raised with nothing re-sent", cp.SndWnd, cp.MaxWindow, cp.SndBuf)
				}
			} else {
				if int(cp.SndWnd) < burst || cp.MaxWindow < cp.SndWnd {
					t.Errorf("snd_wnd %d, max_window %d: the %d-byte burst does not fit", cp.SndWnd, cp.MaxWindow, burst)
				}
				if int(cp.SndBuf) < 2*burst+cp.Segments*SegmentOverhead {
					t.Errorf("sndbuf %d cannot queue %d bytes in %d segments", cp.SndBuf, burst, cp.Segments)
				}
			}
		})
	}
}

func TestPlanConnBadSegment(t *testing.T) {
	if _, err := PlanConn(conn(1, 0, 0, 0, 0), Peer{Live: live(0, 0, 0)}, 0); err == nil {
		t.Fatal("segment size 0 accepted")
	}
	// A burst that cannot fit a congestion window or a send buffer.
	c := conn(1, 0, 0, 0, 0)
	if _, err := PlanConn(c, Peer{Live: live(0, 1<<31-1, 0)}, 1); !errors.Is(err, ErrNotRecoverable) {
		t.Fatalf("2 GiB re-send in 1-byte segments: %v", err)
	}
}

func TestPlanConnTimestampAge(t *testing.T) {
	// The older the peer's reading, the later the restored clock must start.
	c := conn(1, 0, 0, 0, 0)
	var last uint32
	for _, age := range []time.Duration{0, time.Millisecond, 999 * time.Millisecond, 10 * time.Second} {
		cp, err := PlanConn(c, Peer{Live: live(0, 0, 100), LiveAge: age}, 1448)
		if err != nil {
			t.Fatal(err)
		}
		min := live(0, 0, 100).MinRestoredTimestamp(age)
		if seqBefore(cp.Timestamp, min+uint32(TimestampMargin/time.Millisecond)) || seqBefore(cp.Timestamp, last) {
			t.Errorf("age %v: timestamp %d, below %d + margin or below the previous %d", age, cp.Timestamp, min, last)
		}
		last = cp.Timestamp
	}
}

// TestPlanConnRefusesImpossibleLiveAge: the peer's host says how old its live state is. The restored clock
// starts at the peer's last echo plus that age; an age of 2^31 ms or more (24.8 days) wraps it to behind
// what the peer saw, where the peer's PAWS check drops every segment of the restored socket for good. No
// honest peer reports such an age, nor a negative one (its own monotonic clock measured it): refused.
func TestPlanConnRefusesImpossibleLiveAge(t *testing.T) {
	const tsecr = 7000
	c := conn(1, 1000, 5000, 0, 2)
	for _, age := range []time.Duration{
		-time.Millisecond,
		MaxLiveAge + time.Millisecond,
		1<<31*time.Millisecond - TimestampMargin, // plus the margin: exactly half the timestamp space
		1 << 31 * time.Millisecond,
		30 * 24 * time.Hour,
		1 << 32 * time.Millisecond, // the clock wraps back to the echo itself
		math.MaxInt64,
	} {
		cp, err := PlanConn(c, Peer{Live: live(1000, 5000, tsecr), LiveAge: age}, 1448)
		if !errors.Is(err, ErrNotRecoverable) || !strings.Contains(err.Error(), "old") {
			t.Errorf("live state %v old: planned timestamp %d (the peer last saw %d), error %v; want ErrNotRecoverable about the age",
				age, cp.Timestamp, tsecr, err)
		}
	}
	// The oldest age an honest peer may report still starts the clock after the peer's echo.
	cp, err := PlanConn(c, Peer{Live: live(1000, 5000, tsecr), LiveAge: MaxLiveAge}, 1448)
	if err != nil {
		t.Fatal(err)
	}
	if want := live(0, 0, tsecr).MinRestoredTimestamp(MaxLiveAge + TimestampMargin); cp.Timestamp != want || !seqBefore(tsecr, cp.Timestamp) {
		t.Errorf("age %v: timestamp %d, want %d, after the peer's echo %d", MaxLiveAge, cp.Timestamp, want, tsecr)
	}
}

func TestNewPlan(t *testing.T) {
	other := netip.MustParseAddrPort("10.0.0.13:7000")
	c1 := conn(7, 1000, 5000, 100, 2)
	c2 := conn(3, 1000, 9000, 0, 2)
	c2.Remote = other
	k1, k2 := c1.Tuple, c2.Tuple
	peers := map[tcpflow.Tuple]Peer{
		k1: {Live: live(1000, 5000+900, 10)},                  // 100 + 900 bytes burst
		k2: {Live: live(1200, 9000, 10), Logged: logged(200)}, // nothing re-sent
	}
	t.Run("initcwnd is the largest need", func(t *testing.T) {
		p, err := NewPlan([]ckpt.Conn{c1, c2}, peers, 8)
		if err != nil {
			t.Fatal(err)
		}
		if len(p.Conns) != 2 || p.Conns[0].Conn.Inode != 3 || p.Conns[1].Conn.Inode != 7 {
			t.Fatalf("conns %+v, want inodes 3 and 7 in order", p.Conns)
		}
		if want := 1000/8 + CwndMargin; p.InitCwnd != want {
			t.Errorf("initcwnd %d, want %d", p.InitCwnd, want)
		}
	})
	t.Run("at least the kernel's default", func(t *testing.T) {
		p, err := NewPlan([]ckpt.Conn{c2}, peers, 1448)
		if err != nil {
			t.Fatal(err)
		}
		if p.InitCwnd != MinInitCwnd {
			t.Errorf("initcwnd %d, want %d", p.InitCwnd, MinInitCwnd)
		}
		p, err = NewPlan(nil, nil, 1448)
		if err != nil || p.InitCwnd != MinInitCwnd || len(p.Conns) != 0 {
			t.Errorf("empty plan: %+v, %v", p, err)
		}
	})
	t.Run("every problem is reported", func(t *testing.T) {
		c3 := conn(9, 1000, 5000, 0, 2)
		c3.Local = netip.MustParseAddrPort("10.0.0.11:40001")
		short := map[tcpflow.Tuple]Peer{k1: peers[k1], k2: {Live: live(1200, 9000, 10), Logged: logged(5)}}
		_, err := NewPlan([]ckpt.Conn{c1, c2, c3, c1}, short, 1448)
		if !errors.Is(err, ErrNotRecoverable) {
			t.Fatalf("error %v, want ErrNotRecoverable", err)
		}
		for _, want := range []string{k2.String() + " (socket inode 3)", "holds only 5", k1.String() + " appears twice", c3.Tuple.String() + " (socket inode 9): no state from the peer"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q lacks %q", err, want)
			}
		}
	})
}

// TestPlanConnUnackedFIN: a socket dumped after its program shut its sending side down, the FIN not yet
// acknowledged (FIN_WAIT1, CLOSING, LAST_ACK: a peer that does not read keeps it and the last bytes
// queued), has the FIN in CRIU's outq_seq but not in its outq_len, so its snd_una is outq_seq-outq_len-1.
// A peer that acknowledged nothing since is consistent with it and must be planned, not refused as
// acknowledging less than the snapshot knows; one that acknowledges less than snd_una is still refused.
func TestPlanConnUnackedFIN(t *testing.T) {
	finUnacked := func(c ckpt.Conn) ckpt.Conn { c.FinUnacked = true; return c }
	tests := []struct {
		name    string
		c       ckpt.Conn
		ack     uint32
		wantErr string
	}{
		// Data 4900..5000 unacknowledged, the FIN at 5000: outq_seq 5001, outq_len 100.
		{name: "nothing acknowledged since", c: finUnacked(conn(1, 1000, 5001, 100, 2)), ack: 4900},
		{name: "data acknowledged, not the FIN", c: finUnacked(conn(1, 1000, 5001, 100, 2)), ack: 5000},
		{name: "FIN acknowledged", c: finUnacked(conn(1, 1000, 5001, 100, 2)), ack: 5001},
		{name: "only the FIN unacknowledged", c: finUnacked(conn(1, 1000, 5001, 0, 2)), ack: 5000},
		{name: "across the wrap", c: finUnacked(conn(1, 1000, 50, 100, 2)), ack: math.MaxUint32 - 50},
		{name: "ack behind snd_una", c: finUnacked(conn(1, 1000, 5001, 100, 2)), ack: 4899,
			wantErr: "acknowledges up to sequence 4899, 1 bytes before what the snapshot knows it acknowledged (4900)"},
		{name: "established: the FIN is not in outq_seq", c: conn(1, 1000, 5001, 100, 2), ack: 4900,
			wantErr: "acknowledges up to sequence 4900, 1 bytes before what the snapshot knows it acknowledged (4901)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cp, err := PlanConn(tt.c, Peer{Live: live(1000, tt.ack, 10)}, 100)
			if tt.wantErr != "" {
				if !errors.Is(err, ErrNotRecoverable) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want ErrNotRecoverable containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("peer acknowledging %d refused: %v", tt.ack, err)
			}
			if cp.Resend != 0 {
				t.Errorf("resend %d, want 0: the program had written nothing past its FIN", cp.Resend)
			}
		})
	}
}
