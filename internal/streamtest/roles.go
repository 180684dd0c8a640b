//go:build linux

// Package streamtest is the traffic fixture shared by the tests and the
// benchmark of the TCP logging path: a deterministic pseudo-random byte stream,
// child roles run by the re-executed test (or benchmark) binary, cgroup v2
// children to start them in, and the plumbing that starts them on a lab host
// and reads their output.
//
// A binary that uses child roles calls ChildMain first thing (TestMain, init):
// Start re-executes os.Executable with RoleEnv set, and ChildMain then runs the
// role instead of the binary's main function. The shared roles, configured by
// environment variables:
//
//	recv: listen on FTKIT_ADDR, print "ready", accept one connection. With
//	      FTKIT_PAUSE_AT=N read exactly N bytes, print "read N" and wait for a
//	      line on stdin. Read to EOF, print "<bytes> <sha256 hex>".
//	send: connect to FTKIT_ADDR (from local port FTKIT_LPORT if set), print
//	      "conn <local addr:port> <write_seq>" (see ParseConnLine), send
//	      Stream(FTKIT_SEED, FTKIT_SIZE) in writes of 1 B .. 1 MiB, close,
//	      print "sent <bytes>".
package streamtest

import (
	"bufio"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// RoleEnv selects a child role when a binary is re-executed by Start.
const RoleEnv = "FTKIT_STREAMTEST_ROLE"

// ErrUnknownRole is returned by RunChild for a role it does not have.
var ErrUnknownRole = errors.New("unknown child role")

// Stream is the pseudo-random byte stream a sender sends: the same seed and
// size always give the same bytes, and a shorter stream is a prefix of a
// longer one.
func Stream(seed uint64, size int) []byte {
	var key [32]byte
	for i := range 8 {
		key[i] = byte(seed >> (8 * i))
	}
	b := make([]byte, size)
	_, _ = rand.NewChaCha8(key).Read(b)
	return b
}

// ChildMain returns at once unless RoleEnv is set. Otherwise this process is a
// child started by Start: it runs the role (local's first, then RunChild's)
// and exits, 0 on success, 1 with the error on stderr otherwise. With a
// watchdog > 0 the child exits with status 3 after that long, so that it never
// outlives a crashed test run for long.
func ChildMain(local map[string]func() error, watchdog time.Duration) {
	role := os.Getenv(RoleEnv)
	if role == "" {
		return
	}
	if watchdog > 0 {
		time.AfterFunc(watchdog, func() { os.Exit(3) })
	}
	var err error
	if fn, ok := local[role]; ok {
		err = fn()
	} else {
		err = RunChild(role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s child %s: %v\n", filepath.Base(os.Args[0]), role, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// RunChild runs one of the shared roles (see the package documentation).
func RunChild(role string) error {
	switch role {
	case "recv":
		return recv(os.Getenv("FTKIT_ADDR"))
	case "send":
		return send(os.Getenv("FTKIT_ADDR"))
	}
	return fmt.Errorf("%w %q", ErrUnknownRole, role)
}

func recv(addr string) error {
	ln, err := net.Listen("tcp4", addr)
	if err != nil {
		return err
	}
	fmt.Println("ready")
	c, err := ln.Accept()
	if err != nil {
		return err
	}
	h := sha256.New()
	var n int64
	if p := os.Getenv("FTKIT_PAUSE_AT"); p != "" {
		at, err := strconv.ParseInt(p, 10, 64)
		if err != nil {
			return fmt.Errorf("FTKIT_PAUSE_AT: %w", err)
		}
		if n, err = io.CopyN(h, c, at); err != nil {
			return err
		}
		fmt.Printf("read %d\n", n)
		if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
			return fmt.Errorf("wait for go-ahead on stdin: %w", err)
		}
	}
	m, err := io.CopyBuffer(h, c, make([]byte, 1<<20))
	if err != nil {
		return err
	}
	fmt.Printf("%d %x\n", n+m, h.Sum(nil))
	return nil
}

func send(addr string) error {
	seed, err := strconv.ParseUint(os.Getenv("FTKIT_SEED"), 10, 64)
	if err != nil {
		return fmt.Errorf("FTKIT_SEED: %w", err)
	}
	size, err := strconv.Atoi(os.Getenv("FTKIT_SIZE"))
	if err != nil {
		return fmt.Errorf("FTKIT_SIZE: %w", err)
	}
	var d net.Dialer
	if p := os.Getenv("FTKIT_LPORT"); p != "" {
		lport, err := strconv.Atoi(p)
		if err != nil {
			return fmt.Errorf("FTKIT_LPORT: %w", err)
		}
		d.LocalAddr = &net.TCPAddr{Port: lport}
	}
	c, err := d.Dial("tcp4", addr)
	if err != nil {
		return err
	}
	seq, err := WriteSeq(c.(*net.TCPConn))
	if err != nil {
		return err
	}
	fmt.Printf("conn %s %d\n", c.LocalAddr(), seq)
	data := Stream(seed, size)
	sizes := rand.New(rand.NewPCG(seed, 2))
	for off := 0; off < len(data); {
		// 1 B .. 1 MiB, log-uniform: many small writes, some huge.
		n := min(sizes.IntN(1<<sizes.IntN(21))+1, len(data)-off)
		if _, err := c.Write(data[off : off+n]); err != nil {
			return err
		}
		off += n
	}
	if err := c.Close(); err != nil {
		return err
	}
	fmt.Printf("sent %d\n", len(data))
	return nil
}

// ParseConnLine parses the send role's first line, "conn <local addr:port>
// <write_seq>": the connection's source and the sequence number of its first
// byte.
func ParseConnLine(line string) (netip.AddrPort, uint32, error) {
	var src string
	var seq uint32
	if _, err := fmt.Sscanf(line, "conn %s %d", &src, &seq); err != nil {
		return netip.AddrPort{}, 0, fmt.Errorf("sender said %q: %w", line, err)
	}
	ap, err := netip.ParseAddrPort(src)
	if err != nil {
		return netip.AddrPort{}, 0, fmt.Errorf("sender said %q: %w", line, err)
	}
	return ap, seq, nil
}

// The queues TCP_REPAIR_QUEUE selects (include/uapi/linux/tcp.h).
const (
	tcpNoQueue   = 0
	tcpRecvQueue = 1
	tcpSendQueue = 2
)

// WriteSeq reads the socket's write_seq (the sequence number of the next byte
// written) through TCP repair mode, the way CRIU does: an independent check
// that a log is keyed by the real TCP sequence numbers. Before the first
// write it is the peer's copied_seq before its first read.
func WriteSeq(c *net.TCPConn) (uint32, error) { return queueSeq(c, tcpSendQueue) }

// RecvSeq reads the socket's rcv_nxt (the sequence number of the next byte it
// expects from its peer) through TCP repair mode.
func RecvSeq(c *net.TCPConn) (uint32, error) { return queueSeq(c, tcpRecvQueue) }

func queueSeq(c *net.TCPConn, queue int) (uint32, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var seq int
	var serr error
	err = rc.Control(func(fd uintptr) {
		if serr = unix.SetsockoptInt(int(fd), unix.SOL_TCP, unix.TCP_REPAIR, 1); serr != nil {
			serr = fmt.Errorf("enter TCP repair mode: %w", serr)
			return
		}
		// Leave without a window probe (it would be an extra segment), and with no queue selected: with the
		// send queue selected, whatever sends meanwhile takes unsent bytes for sent (criu/patches/0001).
		defer unix.SetsockoptInt(int(fd), unix.SOL_TCP, unix.TCP_REPAIR, unix.TCP_REPAIR_OFF_NO_WP)
		defer unix.SetsockoptInt(int(fd), unix.SOL_TCP, unix.TCP_REPAIR_QUEUE, tcpNoQueue)
		if serr = unix.SetsockoptInt(int(fd), unix.SOL_TCP, unix.TCP_REPAIR_QUEUE, queue); serr != nil {
			serr = fmt.Errorf("select repair queue %d: %w", queue, serr)
			return
		}
		seq, serr = unix.GetsockoptInt(int(fd), unix.SOL_TCP, unix.TCP_QUEUE_SEQ)
	})
	return uint32(seq), errors.Join(err, serr)
}
