//go:build linux

package restore

// End-to-end: a peer's bytes delivered into a live socket with InjectFromPeer while the peer's own
// segments are dropped, in gated parts, then the connection resumes both ways (docs/tcp-relocation.md,
// "Injecting the peer's bytes").

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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

// seqs reads a socket's rcv_nxt and write_seq through TCP_REPAIR, leaving repair mode without the window
// probe TCP_REPAIR_OFF would send. Call it while the connection is quiet.
func seqs(t *testing.T, c *net.TCPConn) (rcvNxt, writeSeq uint32) {
	t.Helper()
	sockCtl(t, c, func(fd int) error {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_REPAIR, unix.TCP_REPAIR_ON); err != nil {
			return fmt.Errorf("TCP_REPAIR on: %w", err)
		}
		defer unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_REPAIR, unix.TCP_REPAIR_OFF_NO_WP)
		for q, p := range map[int]*uint32{1 /* TCP_RECV_QUEUE */ : &rcvNxt, 2 /* TCP_SEND_QUEUE */ : &writeSeq} {
			if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_REPAIR_QUEUE, q); err != nil {
				return fmt.Errorf("TCP_REPAIR_QUEUE %d: %w", q, err)
			}
			v, err := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_QUEUE_SEQ)
			if err != nil {
				return fmt.Errorf("TCP_QUEUE_SEQ of queue %d: %w", q, err)
			}
			*p = uint32(v)
		}
		return nil
	})
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

// dropRule drops, in host's namespace, the connection's segments on eth0 both ways: the peer's on the way
// in (not those injected through lo) and the local socket's ACKs on the way out, so that the peer neither
// delivers its bytes nor learns what was injected. It uses a table of its own and returns the count of the
// peer's segments dropped and the rule's removal.
func dropRule(ctx context.Context, t *testing.T, l *lab.Lab, host string, conn tcpflow.Tuple) (count func() int, remove func()) {
	t.Helper()
	table := fmt.Sprintf("ftkit_inject_%d", os.Getpid())
	script := fmt.Sprintf("table ip %[1]s {\n"+
		"\tchain pre {\n\t\ttype filter hook prerouting priority -300;\n"+
		"\t\tiifname \"eth0\" ip saddr %[2]s ip daddr %[3]s tcp sport %[4]d tcp dport %[5]d counter drop\n\t}\n"+
		"\tchain post {\n\t\ttype filter hook postrouting priority -300;\n"+
		"\t\toifname \"eth0\" ip saddr %[3]s ip daddr %[2]s tcp sport %[5]d tcp dport %[4]d counter drop\n\t}\n}\n",
		table, conn.Remote.Addr(), conn.Local.Addr(), conn.Remote.Port(), conn.Local.Port())
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
	if err := l.Do("node2", func() error { return SetInitCwnd("eth0", 64) }); err != nil {
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

	count, unblock := dropRule(ctx, t, l, "node1", conn)
	const total = 256 << 10
	data := streamBytes(tagInject, 0, total)
	wrote := make(chan error, 1)
	go func() { _, err := sb.Write(data); wrote <- err }()
	// B sends its first flight (dropped), hears nothing, retransmits (dropped too): it will send no new
	// bytes before an ACK, so what it has sent is what can be injected. Only bytes the peer has sent may
	// be: the local socket ACKs them, and the peer drops an ACK of bytes it has not sent (after its
	// snd_nxt); measured: with the ACKs let through and all 256 KiB injected at once, B's SIOCOUTQ stayed
	// at 76640 for 2 minutes after the rule went, the connection stalled for good.
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
	inject := func(h PeerHeader, b []byte) {
		t.Helper()
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
		counter []string // one of them must grow
	}{
		{"TSval behind ts_recent (PAWS)", func(h *PeerHeader) { h.TSval -= 1 << 20 }, []string{"TcpExt:PAWSEstab"}},
		{"ack before snd_una-bytes_acked", func(h *PeerHeader) { h.Ack = sndNxt - uint32(infoA.Bytes_acked) - 1 },
			[]string{"TcpExt:TCPChallengeACK", "TcpExt:TCPACKSkippedChallenge"}},
		{"ack after snd_nxt", func(h *PeerHeader) { h.Ack = sndNxt + 1 }, nil},
	} {
		before, got0 := mibs(t, l, "node1"), received()
		h := hdr(0)
		tc.mod(&h)
		inject(h, garbage)
		if tc.counter != nil {
			waitFor(ctx, t, tc.name+": "+strings.Join(tc.counter, " or "), func() bool {
				after := mibs(t, l, "node1")
				for _, c := range tc.counter {
					if after[c] > before[c] {
						return true
					}
				}
				return false
			})
		}
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
