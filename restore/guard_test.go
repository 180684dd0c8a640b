//go:build linux

package restore

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os/exec"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labtest"
	"github.com/ftkit/ftkit/tcpflow"
)

const testRunID = "0123abcd-4567-89ef-0123-456789abcdef"

func TestGuardTable(t *testing.T) {
	// CRIU keeps 21 characters of the run id (a 32-byte buffer for "inet CRIU-%s").
	if got, want := GuardTable(testRunID), "CRIU-0123abcd-4567-89ef-01"; got != want {
		t.Errorf("GuardTable = %q, want %q", got, want)
	}
	if len("inet "+GuardTable(testRunID)) != 31 {
		t.Errorf("%q is not the 31 characters CRIU's buffer holds", "inet "+GuardTable(testRunID))
	}
}

func TestGuardKeys(t *testing.T) {
	c4 := ckpt.Conn{Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.11:40000"), Remote: netip.MustParseAddrPort("10.0.0.12:7000")}}
	c6 := ckpt.Conn{Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort("[fd00::1]:1"), Remote: netip.MustParseAddrPort("[fd00::2]:258")}}
	mapped := ckpt.Conn{Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort("[::ffff:10.0.0.11]:5"), Remote: netip.MustParseAddrPort("[::ffff:10.0.0.13]:6")}}
	addrs := []netip.Addr{netip.MustParseAddr("10.0.0.11"), netip.MustParseAddr("::ffff:10.0.0.14"), netip.MustParseAddr("fd00::1")}
	k, err := guardKeys([]ckpt.Conn{c4, c6, mapped}, addrs)
	if err != nil {
		t.Fatal(err)
	}
	v6 := func(last byte) []byte { return append(make([]byte, 15, 16), last) }
	fd := func(last byte) []byte { b := v6(last); b[0] = 0xfd; return b }
	cat := func(parts ...[]byte) []byte { return slices.Concat(parts...) }
	want := guardSets{
		v4: [][]byte{ // both directions; the v4-mapped connection in the IPv4 set; ports big-endian, padded to 4 bytes
			{10, 0, 0, 11, 0x9c, 0x40, 0, 0, 10, 0, 0, 12, 0x1b, 0x58, 0, 0},
			{10, 0, 0, 12, 0x1b, 0x58, 0, 0, 10, 0, 0, 11, 0x9c, 0x40, 0, 0},
			{10, 0, 0, 11, 0, 5, 0, 0, 10, 0, 0, 13, 0, 6, 0, 0},
			{10, 0, 0, 13, 0, 6, 0, 0, 10, 0, 0, 11, 0, 5, 0, 0},
		},
		v6: [][]byte{
			cat(fd(1), []byte{0, 1, 0, 0}, fd(2), []byte{1, 2, 0, 0}),
			cat(fd(2), []byte{1, 2, 0, 0}, fd(1), []byte{0, 1, 0, 0}),
		},
		addrs4: [][]byte{{10, 0, 0, 11}, {10, 0, 0, 14}}, // the v4-mapped address in the IPv4 set
		addrs6: [][]byte{fd(1)},
	}
	if !reflect.DeepEqual(k, want) {
		t.Errorf("guardKeys =\n%v\nwant\n%v", k, want)
	}
	mixed := ckpt.Conn{Tuple: tcpflow.Tuple{Local: c4.Local, Remote: c6.Remote}}
	if _, err := guardKeys([]ckpt.Conn{mixed}, nil); err == nil {
		t.Error("a connection with an IPv4 and an IPv6 end was accepted")
	}
	if _, err := guardKeys(nil, []netip.Addr{{}}); err == nil {
		t.Error("an invalid address was accepted")
	}
	for _, id := range []string{"", "x; flush ruleset", strings.ToUpper(testRunID)} {
		if err := Guard(context.Background(), id, nil, nil); err == nil {
			t.Errorf("Guard accepted run id %q", id)
		}
		if err := Unguard(context.Background(), id); err == nil {
			t.Errorf("Unguard accepted run id %q", id)
		}
	}
}

// listGuard is the guard table of testRunID on host as nft lists it.
func listGuard(ctx context.Context, t *testing.T, l *lab.Lab, host string) []byte {
	t.Helper()
	var listed []byte
	if err := l.Do(host, func() error {
		bin, err := nftBinary()
		if err == nil {
			listed, err = execOutput(ctx, bin, "list", "table", "inet", GuardTable(testRunID))
		}
		return err
	}); err != nil {
		t.Fatalf("nft list: %v: %s", err, listed)
	}
	return listed
}

// twoHosts is a lab of two hosts, node1 and node2.
func twoHosts(t *testing.T) (*lab.Lab, lab.Host, lab.Host) {
	t.Helper()
	l := labtest.New(t, 2, 0)
	h1, err1 := l.Host("node1")
	h2, err2 := l.Host("node2")
	if err := errors.Join(err1, err2); err != nil {
		t.Fatal(err)
	}
	return l, h1, h2
}

// TestGuard checks on real traffic that the guard drops the guarded
// connections both ways, lets others through, lets CRIU-marked packets out,
// and that Unguard removes it.
func TestGuard(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	l, h1, h2 := twoHosts(t)
	srv := netip.AddrPortFrom(h2.Addr.Addr(), 7200)
	var ln net.Listener
	if err := l.Do("node2", func() (err error) { ln, err = net.Listen("tcp4", srv.String()); return err }); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	from := func(port uint16) netip.AddrPort { return netip.AddrPortFrom(h1.Addr.Addr(), port) }
	conns := []ckpt.Conn{
		{Tuple: tcpflow.Tuple{Local: from(40200), Remote: srv}, Inode: 1},
		{Tuple: tcpflow.Tuple{Local: from(40201), Remote: srv}, Inode: 2},
		{Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort("[fd00::1]:1"), Remote: netip.MustParseAddrPort("[fd00::2]:2")}, Inode: 3},
	}
	dial := func(lport uint16, mark bool) error {
		return l.Do("node1", func() error {
			d := net.Dialer{Timeout: 300 * time.Millisecond, LocalAddr: net.TCPAddrFromAddrPort(from(lport))}
			if mark {
				d.Control = func(_, _ string, rc syscall.RawConn) error {
					var serr error
					err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, soccrMark) })
					if err != nil {
						return err
					}
					return serr
				}
			}
			c, err := d.DialContext(ctx, "tcp4", srv.String())
			if err == nil {
				c.Close()
			}
			return err
		})
	}
	exists := func() bool {
		t.Helper()
		var ok bool
		if err := l.Do("node1", func() (err error) { ok, err = GuardExists(ctx, testRunID); return err }); err != nil {
			t.Fatal(err)
		}
		return ok
	}

	// A second Guard replaces the table: the connection only the first one
	// named is not guarded any more.
	earlier := append(slices.Clone(conns), ckpt.Conn{Tuple: tcpflow.Tuple{Local: from(40202), Remote: srv}, Inode: 4})
	for _, cs := range [][]ckpt.Conn{earlier, conns} {
		if err := l.Do("node1", func() error { return Guard(ctx, testRunID, cs, nil) }); err != nil {
			t.Fatal(err)
		}
	}
	if !exists() {
		t.Fatal("no guard table after Guard")
	}
	// nft reads the table back as the rules CRIU's own lock has (criu/netfilter.c): the netlink batch
	// built what nft would have, the IPv6 half too, which the traffic below does not exercise.
	listed := listGuard(ctx, t, l, "node1")
	for _, want := range []string{
		"type ipv4_addr . inet_service . ipv4_addr . inet_service",
		"type ipv6_addr . inet_service . ipv6_addr . inet_service",
		from(40200).Addr().String() + " . 40200 . " + srv.Addr().String() + " . 7200",
		srv.Addr().String() + " . 7200 . " + from(40200).Addr().String() + " . 40200",
		"fd00::1 . 1 . fd00::2 . 2", "fd00::2 . 2 . fd00::1 . 1",
		"type filter hook output priority filter; policy accept;",
		"type filter hook input priority filter; policy accept;",
		"meta mark 0x0000c114 accept",
		"ip saddr . tcp sport . ip daddr . tcp dport @conns4 drop",
		"ip6 saddr . tcp sport . ip6 daddr . tcp dport @conns6 drop",
	} {
		if !strings.Contains(string(listed), want) {
			t.Errorf("the guard as nft lists it lacks %q:\n%s", want, listed)
		}
	}
	if strings.Contains(string(listed), "40202") {
		t.Errorf("the replaced guard still names the first one's connection:\n%s", listed)
	}
	if err := dial(40200, false); err == nil {
		t.Error("a guarded connection's SYN got through")
	}
	if err := dial(40202, false); err != nil {
		t.Errorf("an unguarded connection failed: %v", err)
	}
	// A marked SYN leaves (output accepts CRIU's mark) but the SYN-ACK is
	// dropped on input: the server holds a half-open connection.
	if err := dial(40201, true); err == nil {
		t.Error("a guarded connection completed although the SYN-ACK must be dropped on input")
	}
	var synRecv []byte
	if err := l.Do("node2", func() (err error) {
		synRecv, err = exec.Command("ss", "-Htn", "state", "syn-recv").CombinedOutput()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(synRecv), from(40201).String()) {
		t.Errorf("the server saw no SYN from the marked socket %v: ss says %q", from(40201), synRecv)
	}

	for range 2 { // a missing table is fine
		if err := l.Do("node1", func() error { return Unguard(ctx, testRunID) }); err != nil {
			t.Fatal(err)
		}
	}
	if exists() {
		t.Error("guard table still there after Unguard")
	}
	if err := dial(40200, false); err != nil {
		t.Errorf("the connection is still dropped after Unguard: %v", err)
	}
}

// TestGuardHoldsNewConnections: a guard also drops the connection requests coming in to the addresses it
// names, so that a peer connecting to a job CRIU is still restoring (its listening socket not rebuilt yet)
// is not refused: its TCP sends the SYN again and connects once the job listens and the guard is gone.
// The old guard covered only the dump's connections, and the peer's connect failed at once with
// ECONNREFUSED (ci, 2026-12-02: ORTE daemons restored from a cut taken while they started could not reach
// mpirun, restored a moment later on another host). Connections the guarded host opens itself, and
// requests to other addresses, pass.
func TestGuardHoldsNewConnections(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	l, h1, h2 := twoHosts(t)
	job := netip.AddrPortFrom(h2.Addr.Addr(), 7210) // the job being restored on node2
	dial := func(from string, to netip.AddrPort, timeout time.Duration) error {
		return l.Do(from, func() error {
			d := net.Dialer{Timeout: timeout}
			c, err := d.DialContext(ctx, "tcp4", to.String())
			if err == nil {
				c.Close()
			}
			return err
		})
	}
	if err := dial("node1", job, 2*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("before any guard, a connect to %v where nothing listens: %v, want ECONNREFUSED", job, err)
	}
	// A guard of another address lets the request through; the guard of the job's address replaces it.
	for _, addr := range []netip.Addr{netip.MustParseAddr("10.255.255.1"), job.Addr()} {
		if err := l.Do("node2", func() error { return Guard(ctx, testRunID, nil, []netip.Addr{addr}) }); err != nil {
			t.Fatal(err)
		}
		if addr == job.Addr() {
			break
		}
		if err := dial("node1", job, 2*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("a connect to %v, with only %v guarded: %v, want ECONNREFUSED", job, addr, err)
		}
	}
	defer l.Do("node2", func() error { return Unguard(context.Background(), testRunID) })
	listed := listGuard(ctx, t, l, "node2")
	for _, want := range []string{"ip daddr @addrs4 tcp flags syn / syn,ack drop", "ip6 daddr @addrs6 tcp flags syn / syn,ack drop", "elements = { " + job.Addr().String() + " }"} {
		if !strings.Contains(string(listed), want) {
			t.Errorf("the guard as nft lists it lacks %q:\n%s", want, listed)
		}
	}

	// The guarded host connects out: its peer's SYN-ACK (an ACK) passes.
	out := netip.AddrPortFrom(h1.Addr.Addr(), 7211)
	var ln1 net.Listener
	if err := l.Do("node1", func() (err error) { ln1, err = net.Listen("tcp4", out.String()); return err }); err != nil {
		t.Fatal(err)
	}
	defer ln1.Close()
	if err := dial("node2", out, 2*time.Second); err != nil {
		t.Errorf("a connection the guarded host opened failed: %v", err)
	}

	// A peer connects while the job is not listening yet: nothing answers (no reset) ...
	if err := dial("node1", job, 300*time.Millisecond); err == nil || errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("a connect to the guarded address where nothing listens yet: %v, want a timeout (its SYN dropped)", err)
	}
	// ... and one that keeps trying connects once the job listens and the guard is gone, as CRIU's
	// restore of the listening socket and its unlock do.
	done := make(chan error, 1)
	go func() { done <- dial("node1", job, 10*time.Second) }()
	for synSent := false; !synSent; { // its SYN sent and unanswered
		select {
		case err := <-done:
			t.Fatalf("a peer connecting before the job listens: %v, want it waiting", err)
		case <-ctx.Done():
			t.Fatal("the peer's connect never reached SYN-SENT")
		case <-time.After(10 * time.Millisecond):
		}
		if err := l.Do("node1", func() error {
			b, err := exec.Command("ss", "-Htn", "state", "syn-sent", "dst", job.String()).CombinedOutput()
			synSent = err == nil && strings.Contains(string(b), job.String())
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	var ln2 net.Listener
	if err := l.Do("node2", func() (err error) { ln2, err = net.Listen("tcp4", job.String()); return err }); err != nil {
		t.Fatal(err)
	}
	defer ln2.Close()
	if err := l.Do("node2", func() error { return Unguard(ctx, testRunID) }); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Errorf("a peer connecting during the restore: %v, want connected once the job listens", err)
	}
}
