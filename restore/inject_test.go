//go:build linux

package restore

// End-to-end: a peer's bytes delivered into a live socket with InjectFromPeer while the peer's own
// segments are dropped, in gated parts, then the connection resumes both ways (docs/tcp-relocation.md,
// "Injecting the peer's bytes").

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/sockdiag"
	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labtest"
	"github.com/ftkit/ftkit/tcpflow"
)

const tagInject = 0xC3 << 56

// maxPiece is how much TestInjectFromPeer injects before A reads it, in part 2.
const maxPiece = 8 << 10

// sockCtl runs fn on the socket's descriptor.
func sockCtl(t *testing.T, c *net.TCPConn, fn func(fd int) error) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = fn(int(fd)) }); err != nil {
		t.Fatal(err)
	}
	if ferr != nil {
		t.Fatal(ferr)
	}
}

// seqs reads a socket's rcv_nxt and write_seq through TCP_REPAIR (streamtest.RecvSeq, WriteSeq). Call it while
// the connection is quiet.
func seqs(t *testing.T, c *net.TCPConn) (rcvNxt, writeSeq uint32) {
	t.Helper()
	rcvNxt, err := streamtest.RecvSeq(c)
	if err == nil {
		writeSeq, err = streamtest.WriteSeq(c)
	}
	if err != nil {
		t.Fatal(err)
	}
	return rcvNxt, writeSeq
}

func tcpClock(t *testing.T, c *net.TCPConn) (ts uint32) {
	t.Helper()
	sockCtl(t, c, func(fd int) error {
		v, err := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_TIMESTAMP)
		ts = uint32(v)
		return err
	})
	return ts
}

func sockInfo(t *testing.T, c *net.TCPConn) (info *unix.TCPInfo) {
	t.Helper()
	sockCtl(t, c, func(fd int) (err error) {
		info, err = unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
		return err
	})
	return info
}

// queued is the socket's SIOCINQ (unread bytes) or SIOCOUTQ (unacknowledged bytes).
func queued(t *testing.T, c *net.TCPConn, req uint) (n int) {
	t.Helper()
	sockCtl(t, c, func(fd int) (err error) {
		n, err = unix.IoctlGetInt(fd, req)
		return err
	})
	return n
}

// mibs are the TCP counters of host's network namespace (/proc/net/netstat and snmp), "TcpExt:PAWSEstab".
func mibs(t *testing.T, l *lab.Lab, host string) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	if err := l.Do(host, func() error {
		for _, f := range []string{"/proc/thread-self/net/netstat", "/proc/thread-self/net/snmp"} {
			b, err := os.ReadFile(f)
			if err != nil {
				return err
			}
			lines := strings.Split(strings.TrimSpace(string(b)), "\n")
			for i := 0; i+1 < len(lines); i += 2 {
				names, vals := strings.Fields(lines[i]), strings.Fields(lines[i+1])
				for j := 1; j < len(names) && j < len(vals); j++ {
					v, _ := strconv.ParseInt(vals[j], 10, 64)
					out[strings.TrimSuffix(names[0], ":")+":"+names[j]] = v
				}
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// mibDiff lists the counters that changed, for the log.
func mibDiff(before, after map[string]int64) string {
	var s []string
	for k, v := range after {
		if d := v - before[k]; d != 0 && !strings.Contains(k, "InSegs") && !strings.Contains(k, "OutSegs") {
			s = append(s, fmt.Sprintf("%s+%d", k, d))
		}
	}
	return strings.Join(s, " ")
}

// waitFor polls cond until it holds or ctx ends.
func waitFor(ctx context.Context, t *testing.T, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v", what, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

var counterRE = regexp.MustCompile(`counter packets (\d+)`)

var dropRules atomic.Int32 // names each dropRule's table

// dropRule drops, in host's namespace, the connection's segments on eth0: the peer's on the way in (not
// those injected through lo), and if acks the local socket's on the way out too, so that the peer neither
// delivers its bytes nor learns what was injected. It uses a table of its own and returns the count of the
// peer's segments dropped and the rule's removal.
func dropRule(ctx context.Context, t *testing.T, l *lab.Lab, host string, conn tcpflow.Tuple, acks bool) (count func() int, remove func()) {
	t.Helper()
	table := fmt.Sprintf("ftkit_inject_%d_%d", os.Getpid(), dropRules.Add(1))
	out := ""
	if acks {
		out = fmt.Sprintf("\tchain post {\n\t\ttype filter hook postrouting priority -300;\n"+
			"\t\toifname \"eth0\" ip saddr %s ip daddr %s tcp sport %d tcp dport %d counter drop\n\t}\n",
			conn.Local.Addr(), conn.Remote.Addr(), conn.Local.Port(), conn.Remote.Port())
	}
	script := fmt.Sprintf("table ip %s {\n"+
		"\tchain pre {\n\t\ttype filter hook prerouting priority -300;\n"+
		"\t\tiifname \"eth0\" ip saddr %s ip daddr %s tcp sport %d tcp dport %d counter drop\n\t}\n%s}\n",
		table, conn.Remote.Addr(), conn.Local.Addr(), conn.Remote.Port(), conn.Local.Port(), out)
	if err := l.Do(host, func() error { return nft(ctx, script) }); err != nil {
		t.Fatal(err)
	}
	removed := false
	remove = func() {
		if removed {
			return
		}
		removed = true
		if err := l.Do(host, func() error { return nft(context.Background(), "delete table ip "+table+"\n") }); err != nil {
			t.Errorf("remove the drop rule: %v", err)
		}
	}
	t.Cleanup(remove)
	count = func() int {
		var out []byte
		if err := l.Do(host, func() error {
			bin, err := nftBinary()
			if err != nil {
				return err
			}
			out, err = execOutput(ctx, bin, "list", "table", "ip", table)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		m := counterRE.FindSubmatch(out)
		if m == nil {
			t.Fatalf("no counter in %s", out)
		}
		n, _ := strconv.Atoi(string(m[1]))
		return n
	}
	return count, remove
}

// pair is a connection from host b to host a: ra is a's socket (the receiver), sb b's (the sender).
func pair(t *testing.T, l *lab.Lab, a, b string, port uint16) (ra, sb *net.TCPConn, conn tcpflow.Tuple) {
	t.Helper()
	ha, err := l.Host(a)
	if err != nil {
		t.Fatal(err)
	}
	hb, err := l.Host(b)
	if err != nil {
		t.Fatal(err)
	}
	conn = tcpflow.Tuple{Local: netip.AddrPortFrom(ha.Addr.Addr(), port), Remote: netip.AddrPortFrom(hb.Addr.Addr(), port+1)}
	var ln net.Listener
	if err := l.Do(a, func() (err error) { ln, err = net.Listen("tcp4", conn.Local.String()); return err }); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var c net.Conn
	if err := l.Do(b, func() (err error) {
		d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(conn.Remote)}
		c, err = d.Dial("tcp4", conn.Local.String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	ra, sb = s.(*net.TCPConn), c.(*net.TCPConn)
	t.Cleanup(func() { ra.Close(); sb.Close() })
	return ra, sb, conn
}

func execOutput(ctx context.Context, bin string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, bin, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.Bytes(), err
}

// readN reads exactly n bytes from c, failing the test at ctx's deadline.
func readN(ctx context.Context, t *testing.T, c *net.TCPConn, n int) []byte {
	t.Helper()
	if d, ok := ctx.Deadline(); ok {
		c.SetReadDeadline(d)
		defer c.SetReadDeadline(time.Time{})
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(c, b); err != nil {
		t.Fatalf("read %d bytes from %s: %v", n, c.LocalAddr(), err)
	}
	return b
}

// TestInjectFromPeer: node2 (B) writes 256 KiB to node1 (A) while a rule on A drops B's segments; the
// bytes reach A's socket only through InjectFromPeer, in order: first the cases the socket must refuse
// (garbage bytes at rcv_nxt, so that acceptance would show in what A reads), then the accepted variants,
// then part 1 as one segment that A reads whole with one large read before part 2 is sent, then part 2
// paced by what A has read. Then the rule goes: B's unacknowledged bytes drain (SIOCOUTQ 0, its write
// returns) and fresh bytes go both ways intact; B's segments never fail PAWS at A.
func TestInjectFromPeer(t *testing.T) {
	labtest.RequireRoot(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	l := labtest.New(t, 2, 0)
	// B's first flight fills A's initial window (64 KiB), all of which the test injects.
	if err := l.Do("node2", func() error { _, err := SetInitCwnd("eth0", 64); return err }); err != nil {
		t.Fatal(err)
	}
	ra, sb, conn := pair(t, l, "node1", "node2", 7300)

	// A few bytes each way: both sockets have had bytes acknowledged (bytes_acked > 0 bounds old acks).
	if _, err := ra.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	readN(ctx, t, sb, 5)
	if _, err := sb.Write([]byte("hi")); err != nil {
		t.Fatal(err)
	}
	readN(ctx, t, ra, 2)
	waitFor(ctx, t, "A's hello acknowledged", func() bool { return queued(t, ra, unix.SIOCOUTQ) == 0 })
	infoA := sockInfo(t, ra)
	if infoA.Options&1 == 0 { // TCPI_OPT_TIMESTAMPS
		t.Fatalf("the connection did not negotiate timestamps (tcpi_options %#x); the test needs them", infoA.Options)
	}
	rcvNxt, sndNxt := seqs(t, ra) // quiet: snd_una == snd_nxt == write_seq
	diagB, err := l.TCPSockets("node2")
	if err != nil {
		t.Fatal(err)
	}
	wscale := diagB[conn.Reverse()].Rcv_wscale // B's receive scale is A's send scale
	t.Logf("A: rcv_nxt %d snd_nxt %d bytes_acked %d rcv_mss %d rcv_wnd %d; B: rcv_wscale %d",
		rcvNxt, sndNxt, infoA.Bytes_acked, infoA.Rcv_mss, infoA.Rcv_wnd, wscale)

	count, unblock := dropRule(ctx, t, l, "node1", conn, true)
	const total = 256 << 10
	data := streamBytes(tagInject, 0, total)
	wrote := make(chan error, 1)
	go func() { _, err := sb.Write(data); wrote <- err }()
	// B sends its first flight (dropped), hears nothing, retransmits (dropped too): it will send no new
	// bytes before an ACK, so what it has sent is what can be injected. Only bytes the peer has sent may
	// be: the local socket ACKs them, and the peer drops an ACK of bytes it has not sent (after its
	// snd_nxt); measured: with the ACKs let through and all 256 KiB injected at once, B's SIOCOUTQ stayed
	// at 76640 for 2 minutes after the rule went (TestInjectFromPeerLimits shows the dropped ACK).
	waitFor(ctx, t, "B to retransmit its dropped first flight", func() bool { return sockInfo(t, sb).Total_retrans > 0 })
	sentB := func() int { i := sockInfo(t, sb); return int(i.Bytes_sent-i.Bytes_retrans) - 2 /* "hi" */ }
	n := sentB()
	t.Logf("B sent %d bytes before its first retransmission; the rule dropped %d segments", n, count())
	if n < 3000+2*maxPiece {
		t.Fatalf("B's first flight is %d bytes; the test needs at least %d (is the initcwnd route metric set?)", n, 3000+2*maxPiece)
	}

	hdr := func(off int) PeerHeader {
		return PeerHeader{Seq: rcvNxt + uint32(off), Ack: sndNxt, Window: uint16(min(0xffff, sockInfo(t, sb).Rcv_wnd>>wscale)),
			TS: true, TSval: tcpClock(t, sb), TSecr: tcpClock(t, ra)}
	}
	var lastWindow uint16
	inject := func(h PeerHeader, b []byte) {
		t.Helper()
		lastWindow = h.Window
		if err := l.Do("node1", func() error { return InjectFromPeer(conn, h, b) }); err != nil {
			t.Fatal(err)
		}
	}
	received := func() uint64 { return sockInfo(t, ra).Bytes_received }

	// Refused: each a garbage segment at rcv_nxt. Where a counter says the segment was seen and dropped,
	// wait for it; the accepted injections that follow carry the real bytes at the same sequence numbers,
	// so a garbage segment taken in would show in what A reads.
	garbage := bytes.Repeat([]byte{'X'}, 1000)
	for _, tc := range []struct {
		name    string
		mod     func(h *PeerHeader)
		counter []string // one of them grows when the segment is dropped
	}{
		{"TSval behind ts_recent (PAWS)", func(h *PeerHeader) { h.TSval -= 1 << 20 }, []string{"TcpExt:PAWSEstab"}},
		{"ack before snd_una-bytes_acked", func(h *PeerHeader) { h.Ack = sndNxt - uint32(infoA.Bytes_acked) - 1 },
			[]string{"TcpExt:TCPChallengeACK", "TcpExt:TCPACKSkippedChallenge"}},
		{"ack after snd_nxt", func(h *PeerHeader) { h.Ack = sndNxt + 1 },
			[]string{"TcpExt:TCPChallengeACK", "TcpExt:TCPACKSkippedChallenge"}},
	} {
		before, got0 := mibs(t, l, "node1"), received()
		h := hdr(0)
		tc.mod(&h)
		inject(h, garbage)
		waitFor(ctx, t, tc.name+": "+strings.Join(tc.counter, " or "), func() bool {
			after := mibs(t, l, "node1")
			for _, c := range tc.counter {
				if after[c] > before[c] {
					return true
				}
			}
			return false
		})
		after := mibs(t, l, "node1")
		t.Logf("%s: A's counters %s", tc.name, mibDiff(before, after))
		if q, got := queued(t, ra, unix.SIOCINQ), received(); q != 0 || got != got0 {
			t.Errorf("%s: accepted (A's SIOCINQ %d, bytes_received %d -> %d)", tc.name, q, got0, got)
		}
	}

	// Accepted variants, each then read back.
	mibsAccepted := mibs(t, l, "node1")
	pawsBefore := mibsAccepted["TcpExt:PAWSEstab"]
	off := 0
	for _, tc := range []struct {
		name string
		mod  func(h *PeerHeader)
		len  int
	}{
		{"no timestamp option", func(h *PeerHeader) { h.TS = false }, 1000},
		{"ack below snd_una within bytes_acked", func(h *PeerHeader) { h.Ack = sndNxt - uint32(infoA.Bytes_acked) }, 1000},
		{"ack at snd_nxt, TSval of B's clock", func(h *PeerHeader) {}, 1000},
	} {
		h := hdr(off)
		tc.mod(&h)
		inject(h, data[off:off+tc.len])
		if got := readN(ctx, t, ra, tc.len); !bytes.Equal(got, data[off:off+tc.len]) {
			t.Fatalf("%s: A read other bytes than injected (garbage taken before?): % x...", tc.name, got[:16])
		}
		off += tc.len
	}

	// Part 1: 3000 bytes above, then as many as one segment may carry; one read with a buffer for
	// everything returns exactly them.
	part1 := MaxInjectPayload / 2
	h := hdr(off)
	h.MaxPayload = MaxInjectPayload
	inject(h, data[off:off+part1])
	buf := make([]byte, total)
	ra.SetReadDeadline(time.Now().Add(time.Minute))
	k, err := ra.Read(buf)
	if err != nil || k != part1 || !bytes.Equal(buf[:k], data[off:off+part1]) {
		t.Fatalf("part 1: one read returned %d bytes (%v), want exactly the %d injected", k, err, part1)
	}
	if q := queued(t, ra, unix.SIOCINQ); q != 0 {
		t.Fatalf("part 1 read, yet %d more bytes queued at A before part 2 was injected", q)
	}
	off += part1

	// Part 2: the rest of what B sent, maxPiece at a time in segments of the default size, each piece
	// once A has read the previous one.
	pieces := 0
	for off < n {
		end := min(off+maxPiece, n)
		inject(hdr(off), data[off:end])
		if got := readN(ctx, t, ra, end-off); !bytes.Equal(got, data[off:end]) {
			t.Fatalf("part 2: A read other bytes at offset %d", off)
		}
		off = end
		pieces++
	}
	t.Logf("injected: 3000 bytes, part 1 %d bytes (one read), part 2 %d bytes in %d pieces", part1, n-3000-part1, pieces)
	if q := queued(t, ra, unix.SIOCINQ); q != 0 {
		t.Errorf("%d bytes queued at A beyond the %d injected", q, n)
	}
	// The window field became A's idea of B's receive window (the data segments advance snd_wl1).
	if got, want := sockInfo(t, ra).Snd_wnd, uint32(lastWindow)<<wscale; got != want {
		t.Errorf("A's snd_wnd is %d after segments with window field %d (scale %d), want %d", got, lastWindow, wscale, want)
	}
	if got := sentB(); got != n {
		t.Fatalf("B sent new bytes while the rule dropped A's ACKs: %d, was %d", got, n)
	}
	before := mibs(t, l, "node1")
	t.Logf("all injected: B's SIOCOUTQ %d, retransmitted segments %d, rule dropped %d; A's counters since the accepted injections: %s",
		queued(t, sb, unix.SIOCOUTQ), sockInfo(t, sb).Total_retrans, count(), mibDiff(mibsAccepted, before))

	// The rule goes: B's next retransmission is a duplicate at A, which drops it and answers with a D-SACK
	// whose ack, A's rcv_nxt, B accepts: its snd_una catches up, the rest of its 256 KiB flows natively.
	unblock()
	rest := readN(ctx, t, ra, total-n)
	if !bytes.Equal(rest, data[n:]) {
		t.Error("B's bytes after the injected ones differ at A")
	}
	waitFor(ctx, t, "B's unacknowledged bytes drained", func() bool { return queued(t, sb, unix.SIOCOUTQ) == 0 })
	if err := <-wrote; err != nil {
		t.Fatalf("B's write: %v", err)
	}
	after := mibs(t, l, "node1")
	t.Logf("rule removed, B's 256 KiB acknowledged: A's counters %s", mibDiff(before, after))
	if after["TcpExt:TCPDSACKOldSent"] <= before["TcpExt:TCPDSACKOldSent"] {
		t.Errorf("A sent no D-SACK: B's retransmission of injected bytes did not arrive as a duplicate")
	}

	// Fresh bytes both ways.
	back := streamBytes(tagInject, total, total+100_000)
	go func() { sb.Write(back) }()
	if got := readN(ctx, t, ra, len(back)); !bytes.Equal(got, back) {
		t.Error("B -> A after the injection: bytes differ")
	}
	fwd := streamBytes(tagJob, 0, 100_000)
	go func() { ra.Write(fwd) }()
	if got := readN(ctx, t, sb, len(fwd)); !bytes.Equal(got, fwd) {
		t.Error("A -> B after the injection: bytes differ")
	}
	if paws := mibs(t, l, "node1")["TcpExt:PAWSEstab"]; paws != pawsBefore {
		t.Errorf("%d of B's segments failed PAWS at A after the injections", paws-pawsBefore)
	}
}

func rmemAlloc(t *testing.T, c *net.TCPConn) (n int) {
	t.Helper()
	sockCtl(t, c, func(fd int) error {
		var mi [9]uint32 // SK_MEMINFO_VARS
		l := uint32(len(mi) * 4)
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_MEMINFO,
			uintptr(unsafe.Pointer(&mi[0])), uintptr(unsafe.Pointer(&l)), 0)
		if errno != 0 {
			return errno
		}
		n = int(mi[0]) // SK_MEMINFO_RMEM_ALLOC
		return nil
	})
	return n
}

// TestInjectFromPeerLimits measures what InjectFromPeer's doc states beyond TestInjectFromPeer: a TSval
// ahead of the peer's clock makes the peer's own later segments fail PAWS; segments beyond the injected
// point wait in the out-of-order queue and merge; bytes beyond the receive window are dropped; what a large
// segment costs in receive memory; the peer drops an ACK of injected bytes it has not sent.
func TestInjectFromPeerLimits(t *testing.T) {
	labtest.RequireRoot(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	l := labtest.New(t, 2, 0)

	t.Run("out of order, window, segment size", func(t *testing.T) {
		ra, sb, conn := pair(t, l, "node1", "node2", 7320)
		readN(ctx, t, sb, writeAll(t, ra, []byte("hello")))
		waitFor(ctx, t, "A's hello acknowledged", func() bool { return queued(t, ra, unix.SIOCOUTQ) == 0 })
		rcvNxt, sndNxt := seqs(t, ra)
		// The peer hears nothing of this: its stream is not the garbage injected here.
		dropRule(ctx, t, l, "node1", conn, true)
		inject := func(off int, b []byte, max int) {
			t.Helper()
			h := PeerHeader{Seq: rcvNxt + uint32(off), Ack: sndNxt, Window: 64, TS: true, TSval: tcpClock(t, sb), TSecr: tcpClock(t, ra), MaxPayload: max}
			if err := l.Do("node1", func() error { return InjectFromPeer(conn, h, b) }); err != nil {
				t.Fatal(err)
			}
		}
		junk := func(n int, c byte) []byte { return bytes.Repeat([]byte{c}, n) }

		// Out of order: a segment 10000 bytes ahead waits, the gap's bytes merge it.
		m0 := mibs(t, l, "node1")
		inject(10000, junk(1000, 'b'), 0)
		if q := queued(t, ra, unix.SIOCINQ); q != 0 {
			t.Fatalf("a segment beyond rcv_nxt is readable (%d bytes)", q)
		}
		inject(0, junk(10000, 'a'), 0)
		waitFor(ctx, t, "the gap filled", func() bool { return queued(t, ra, unix.SIOCINQ) == 11000 })
		got := readN(ctx, t, ra, 11000)
		if !bytes.Equal(got, append(junk(10000, 'a'), junk(1000, 'b')...)) {
			t.Error("out-of-order bytes merged wrongly")
		}
		m1 := mibs(t, l, "node1")
		t.Logf("out of order then gap: A's counters %s", mibDiff(m0, m1))
		off := 11000

		// A burst of twice the receive window: what lies beyond the window is dropped.
		wnd := int(sockInfo(t, ra).Rcv_wnd)
		inject(off, junk(2*wnd, 'd'), 0)
		segs := int64((2*wnd + DefaultInjectPayload - 1) / DefaultInjectPayload)
		var m2 map[string]int64
		waitFor(ctx, t, "TCP to have taken in the burst's segments", func() bool {
			m2 = mibs(t, l, "node1")
			return m2["Tcp:InSegs"]-m1["Tcp:InSegs"] >= segs
		})
		nxt, _ := seqs(t, ra)
		took := int(nxt - rcvNxt - uint32(off))
		t.Logf("a burst of %d bytes into a window of %d: A took %d (SIOCINQ %d); counters %s",
			2*wnd, wnd, took, queued(t, ra, unix.SIOCINQ), mibDiff(m1, m2))
		if took >= 2*wnd || took < wnd {
			t.Errorf("A took %d of a %d-byte burst into its %d-byte window", took, 2*wnd, wnd)
		}
		readN(ctx, t, ra, took)
		off += took

		// Receive memory charged for the same bytes in one large segment and in default-size ones.
		for _, max := range []int{MaxInjectPayload, DefaultInjectPayload} {
			n := min(int(sockInfo(t, ra).Rcv_wnd), MaxInjectPayload)
			inject(off, junk(n, 'e'), max)
			waitFor(ctx, t, "the bytes queued", func() bool { return queued(t, ra, unix.SIOCINQ) == n })
			t.Logf("%d bytes in segments of %d: receive memory %d", n, max, rmemAlloc(t, ra))
			readN(ctx, t, ra, n)
			off += n
		}
	})
	t.Run("TSval ahead of the peer's clock", func(t *testing.T) {
		ra, sb, conn := pair(t, l, "node1", "node2", 7310)
		readN(ctx, t, sb, writeAll(t, ra, []byte("hello")))
		waitFor(ctx, t, "A's hello acknowledged", func() bool { return queued(t, ra, unix.SIOCOUTQ) == 0 })
		rcvNxt, sndNxt := seqs(t, ra)
		_, unblock := dropRule(ctx, t, l, "node1", conn, true)
		data := streamBytes(tagInject, 0, 1000)
		writeAll(t, sb, data)
		waitFor(ctx, t, "B to retransmit", func() bool { return sockInfo(t, sb).Total_retrans > 0 })
		h := PeerHeader{Seq: rcvNxt, Ack: sndNxt, Window: 64, TS: true, TSval: tcpClock(t, sb) + 1<<30, TSecr: tcpClock(t, ra)}
		if err := l.Do("node1", func() error { return InjectFromPeer(conn, h, data) }); err != nil {
			t.Fatal(err)
		}
		if got := readN(ctx, t, ra, len(data)); !bytes.Equal(got, data) {
			t.Fatal("A read other bytes than injected")
		}
		unblock()
		// B's retransmission of the injected bytes fails PAWS now; A's duplicate ACK still acknowledges them.
		waitFor(ctx, t, "B's bytes acknowledged", func() bool { return queued(t, sb, unix.SIOCOUTQ) == 0 })
		paws, got0 := mibs(t, l, "node1")["TcpExt:PAWSEstab"], sockInfo(t, ra).Bytes_received
		writeAll(t, sb, streamBytes(tagInject, 1000, 1100))
		waitFor(ctx, t, "B's new bytes to fail PAWS at A", func() bool { return mibs(t, l, "node1")["TcpExt:PAWSEstab"] > paws })
		if q, got := queued(t, ra, unix.SIOCINQ), sockInfo(t, ra).Bytes_received; q != 0 || got != got0 {
			t.Errorf("B's new bytes were accepted (SIOCINQ %d, bytes_received %d -> %d)", q, got0, got)
		}
		t.Logf("TSval 2^30 ahead of B's clock: B's next segment fails PAWS at A (TcpExt:PAWSEstab %d -> %d), its bytes are not delivered",
			paws, mibs(t, l, "node1")["TcpExt:PAWSEstab"])
	})

	t.Run("bytes the peer has not sent", func(t *testing.T) {
		ra, sb, conn := pair(t, l, "node1", "node2", 7340)
		readN(ctx, t, sb, writeAll(t, ra, []byte("hello")))
		waitFor(ctx, t, "A's hello acknowledged", func() bool { return queued(t, ra, unix.SIOCOUTQ) == 0 })
		rcvNxt, sndNxt := seqs(t, ra)
		dropRule(ctx, t, l, "node1", conn, false) // B's segments only: A's ACKs reach B
		const total, injected = 256 << 10, 60000
		data := streamBytes(tagInject, 0, total)
		go sb.Write(data)
		waitFor(ctx, t, "B to retransmit", func() bool { return sockInfo(t, sb).Total_retrans > 0 })
		i := sockInfo(t, sb)
		sent, outq := int(i.Bytes_sent-i.Bytes_retrans), queued(t, sb, unix.SIOCOUTQ)
		if sent >= injected {
			t.Fatalf("B's first flight is %d bytes, the test injects %d to go beyond it", sent, injected)
		}
		before := mibs(t, l, "node2")
		// B's own bytes, beyond what it has sent.
		h := PeerHeader{Seq: rcvNxt, Ack: sndNxt, Window: 64, TS: true, TSval: tcpClock(t, sb), TSecr: tcpClock(t, ra)}
		if err := l.Do("node1", func() error { return InjectFromPeer(conn, h, data[:injected]) }); err != nil {
			t.Fatal(err)
		}
		if got := readN(ctx, t, ra, injected); !bytes.Equal(got, data[:injected]) {
			t.Fatal("A read other bytes than injected")
		}
		waitFor(ctx, t, "B to drop A's ACK of bytes it has not sent", func() bool {
			after := mibs(t, l, "node2")
			return after["TcpExt:TCPChallengeACK"] > before["TcpExt:TCPChallengeACK"] ||
				after["TcpExt:TCPACKSkippedChallenge"] > before["TcpExt:TCPACKSkippedChallenge"]
		})
		t.Logf("B had sent %d bytes (SIOCOUTQ %d), %d injected: B's counters %s, SIOCOUTQ %d",
			sent, outq, injected, mibDiff(before, mibs(t, l, "node2")), queued(t, sb, unix.SIOCOUTQ))
	})
}

// writeAll writes b to c and returns its length.
func writeAll(t *testing.T, c *net.TCPConn, b []byte) int {
	t.Helper()
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
	return len(b)
}

// repairedSocket makes, in host's namespace, an established socket from local to remote the way CRIU
// restores one (TCP_REPAIR: sequence numbers set, connect without a handshake, MSS and timestamp options,
// repair off without a window probe), with rcv_nxt rcvNxt and snd_nxt sndNxt and nothing queued. Its peer
// need not exist: the caller drops what it sends.
func repairedSocket(t *testing.T, l *lab.Lab, host string, conn tcpflow.Tuple, rcvNxt, sndNxt uint32) *net.TCPConn {
	t.Helper()
	var f *os.File
	if err := l.Do(host, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		f = os.NewFile(uintptr(fd), "repaired")
		set := func(opt, v int) error { return unix.SetsockoptInt(fd, unix.IPPROTO_TCP, opt, v) }
		if err := set(unix.TCP_REPAIR, unix.TCP_REPAIR_ON); err != nil {
			return fmt.Errorf("TCP_REPAIR: %w", err)
		}
		for q, seq := range map[int]uint32{1: rcvNxt, 2: sndNxt} {
			if err := set(unix.TCP_REPAIR_QUEUE, q); err != nil {
				return err
			}
			if err := set(unix.TCP_QUEUE_SEQ, int(int32(seq))); err != nil {
				return fmt.Errorf("TCP_QUEUE_SEQ: %w", err)
			}
		}
		if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: conn.Local.Addr().As4(), Port: int(conn.Local.Port())}); err != nil {
			return err
		}
		if err := unix.Connect(fd, &unix.SockaddrInet4{Addr: conn.Remote.Addr().As4(), Port: int(conn.Remote.Port())}); err != nil {
			return fmt.Errorf("repair connect: %w", err)
		}
		var opts []byte // struct tcp_repair_opt { u32 code, val }: MSS 1448, timestamps
		for _, o := range [][2]uint32{{2 /* TCPOPT_MSS */, 1448}, {8 /* TCPOPT_TIMESTAMP */, 0}} {
			opts = binary.NativeEndian.AppendUint32(binary.NativeEndian.AppendUint32(opts, o[0]), o[1])
		}
		if err := unix.SetsockoptString(fd, unix.IPPROTO_TCP, unix.TCP_REPAIR_OPTIONS, string(opts)); err != nil {
			return fmt.Errorf("TCP_REPAIR_OPTIONS: %w", err)
		}
		return set(unix.TCP_REPAIR, unix.TCP_REPAIR_OFF_NO_WP)
	}); err != nil {
		if f != nil {
			f.Close()
		}
		t.Fatal(err)
	}
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

// TestInjectIntoRepairedSocket: on a socket fresh from TCP_REPAIR, as CRIU restores one, any TSval passes
// PAWS (its ts_recent is 0) and then becomes ts_recent; and an ack below snd_una is too old (its
// bytes_acked is 0), while ack == snd_una passes.
func TestInjectIntoRepairedSocket(t *testing.T) {
	labtest.RequireRoot(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	l := labtest.New(t, 2, 0)
	ha, _ := l.Host("node1")
	hb, _ := l.Host("node2")
	conn := tcpflow.Tuple{Local: netip.AddrPortFrom(ha.Addr.Addr(), 7330), Remote: netip.AddrPortFrom(hb.Addr.Addr(), 7331)}
	dropRule(ctx, t, l, "node1", conn, true) // no socket at node2: it would answer A's ACKs with a reset
	const rcvNxt, sndNxt = 0xfffff000, 0x10000000
	ra := repairedSocket(t, l, "node1", conn, rcvNxt, sndNxt)
	if i := sockInfo(t, ra); i.Options&1 == 0 || i.Bytes_acked != 0 {
		t.Fatalf("repaired socket: tcpi_options %#x bytes_acked %d, want timestamps and 0", i.Options, i.Bytes_acked)
	}
	inject := func(off int, b []byte, ack, tsval uint32) {
		t.Helper()
		h := PeerHeader{Seq: rcvNxt + uint32(off), Ack: ack, Window: 1000, TS: true, TSval: tsval}
		if err := l.Do("node1", func() error { return InjectFromPeer(conn, h, b) }); err != nil {
			t.Fatal(err)
		}
	}
	refused := func(what string, counters ...string) {
		t.Helper()
		before, got0 := mibs(t, l, "node1"), sockInfo(t, ra).Bytes_received
		inject(0, []byte("garbage"), sndNxt-1, 5)
		waitFor(ctx, t, what, func() bool {
			after := mibs(t, l, "node1")
			for _, c := range counters {
				if after[c] > before[c] {
					return true
				}
			}
			return false
		})
		if q, got := queued(t, ra, unix.SIOCINQ), sockInfo(t, ra).Bytes_received; q != 0 || got != got0 {
			t.Errorf("%s: accepted (SIOCINQ %d, bytes_received %d -> %d)", what, q, got0, got)
		}
	}
	refused("ack snd_una-1 refused as too old", "TcpExt:TCPChallengeACK", "TcpExt:TCPACKSkippedChallenge")

	data := streamBytes(tagInject, 0, 8192) // crosses the 2^32 wrap of the sequence space at 4096
	inject(0, data[:4096], sndNxt, 5)       // TSval 5: far behind any real clock, yet ts_recent is 0
	if got := readN(ctx, t, ra, 4096); !bytes.Equal(got, data[:4096]) {
		t.Fatal("A read other bytes than injected")
	}
	before := mibs(t, l, "node1")
	inject(4096, data[4096:], sndNxt, 2) // now ts_recent is 5: 2 fails PAWS
	waitFor(ctx, t, "TSval 2 after 5 to fail PAWS", func() bool { return mibs(t, l, "node1")["TcpExt:PAWSEstab"] > before["TcpExt:PAWSEstab"] })
	if q := queued(t, ra, unix.SIOCINQ); q != 0 {
		t.Errorf("TSval 2 after 5 accepted (%d bytes queued)", q)
	}
	inject(4096, data[4096:], sndNxt, 4) // within PAWS's window of 1
	if got := readN(ctx, t, ra, 4096); !bytes.Equal(got, data[4096:]) {
		t.Fatal("A read other bytes than injected")
	}
}

// TestDeliverFromPeer: 1 MiB delivered into a socket whose window is far smaller, while its application
// reads: InjectFromPeer alone loses what lies beyond the window (BeyondWindow), DeliverFromPeer re-injects
// it as the window opens, and the application reads every byte in order.
func TestDeliverFromPeer(t *testing.T) {
	labtest.RequireRoot(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	l := labtest.New(t, 2, 0)
	ra, sb, conn := pair(t, l, "node1", "node2", 7360)
	readN(ctx, t, sb, writeAll(t, ra, []byte("hello")))
	waitFor(ctx, t, "A's hello acknowledged", func() bool { return queued(t, ra, unix.SIOCOUTQ) == 0 })
	rcvNxt, sndNxt := seqs(t, ra)
	dropRule(ctx, t, l, "node1", conn, true) // the peer hears nothing of these bytes, which it never sent
	const n = 1 << 20
	data := streamBytes(tagInject, 0, n)
	m0 := mibs(t, l, "node1")
	// The application starts reading once the socket has dropped bytes beyond its window.
	got := make(chan []byte, 1)
	go func() {
		for mibs(t, l, "node1")["TcpExt:BeyondWindow"] == m0["TcpExt:BeyondWindow"] && ctx.Err() == nil {
			time.Sleep(time.Millisecond)
		}
		b := make([]byte, n)
		ra.SetReadDeadline(time.Now().Add(time.Minute))
		k, _ := io.ReadFull(ra, b)
		got <- b[:k]
	}()
	var received0 uint64
	err := l.Do("node1", func() (err error) {
		s, err := sockdiag.Lookup(conn)
		if err != nil {
			return err
		}
		received0 = s.Received
		h := PeerHeader{Seq: rcvNxt, Ack: sndNxt, Window: 64, TS: true, TSval: tcpClock(t, sb)}
		return DeliverFromPeer(ctx, conn, h, data, func() (uint32, int, error) {
			s, err := sockdiag.Lookup(conn)
			return rcvNxt + uint32(s.Received-received0), s.Unread, err
		}, 50*time.Millisecond)
	})
	if err != nil {
		t.Fatal(err)
	}
	b := <-got
	m1 := mibs(t, l, "node1")
	t.Logf("1 MiB delivered, A's window now %d: A's counters %s", sockInfo(t, ra).Rcv_wnd, mibDiff(m0, m1))
	if !bytes.Equal(b, data) {
		t.Fatalf("A read %d bytes, not the %d delivered in order", len(b), n)
	}
}

// TestDeliverFIN: a FIN injected at a socket's rcv_nxt as its peer's ends the stream there: the socket
// takes it (CLOSE_WAIT), and its reader, having read every byte before it, reads the end of the stream.
func TestDeliverFIN(t *testing.T) {
	labtest.RequireRoot(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	l := labtest.New(t, 2, 0)
	ra, sb, conn := pair(t, l, "node1", "node2", 7361)
	readN(ctx, t, sb, writeAll(t, ra, []byte("hello")))
	waitFor(ctx, t, "A's hello acknowledged", func() bool { return queued(t, ra, unix.SIOCOUTQ) == 0 })
	writeAll(t, sb, []byte("from B"))
	readN(ctx, t, ra, 6)
	rcvNxt, sndNxt := seqs(t, ra)
	dropRule(ctx, t, l, "node1", conn, true) // B never sent this FIN: it hears nothing of A's answer
	err := l.Do("node1", func() error {
		h := PeerHeader{Seq: rcvNxt, Ack: sndNxt, Window: 64, TS: true, TSval: tcpClock(t, sb)}
		return DeliverFIN(ctx, conn, h, func() (bool, error) {
			s, err := sockdiag.Lookup(conn)
			return s.FinReceived(), err
		}, 50*time.Millisecond)
	})
	if err != nil {
		t.Fatal(err)
	}
	ra.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := ra.Read(make([]byte, 16)); n != 0 || err != io.EOF {
		t.Errorf("A's read after the FIN: %d bytes, %v; want the end of the stream", n, err)
	}
}
