//go:build linux

package restore

// End-to-end: a bulk sender's socket restored by CRIU keeps the segment size
// and TCP options it had (docs/tcp-relocation.md, "Segment size").

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labtest"
	"github.com/ftkit/ftkit/tcpflow"
)

// bulkSendRole connects from FTKIT_LOCAL to FTKIT_PEER and writes 64 KiB at
// a time until the connection breaks.
func bulkSendRole() error {
	local, err := netip.ParseAddrPort(os.Getenv("FTKIT_LOCAL"))
	if err != nil {
		return err
	}
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(local)}
	c, err := d.Dial("tcp4", os.Getenv("FTKIT_PEER"))
	if err != nil {
		return err
	}
	buf := make([]byte, 64<<10)
	for {
		if _, err := c.Write(buf); err != nil {
			return err
		}
	}
}

// bulkSinkRole listens on FTKIT_ADDR, prints "ready", accepts one
// connection and discards what it reads.
func bulkSinkRole() error {
	ln, err := net.Listen("tcp4", os.Getenv("FTKIT_ADDR"))
	if err != nil {
		return err
	}
	fmt.Println("ready")
	c, err := ln.Accept()
	if err != nil {
		return err
	}
	ln.Close()
	_, err = io.Copy(io.Discard, c)
	return err
}

// tcpInfo is the kernel's TCP_INFO of the socket f (local end on host), read
// with sock_diag; ok is false if there is no such socket.
func tcpInfo(l *lab.Lab, host string, f tcpflow.Tuple) (info netlink.TCPInfo, ok bool, err error) {
	socks, err := l.TCPSockets(host)
	info, ok = socks[f]
	return info, ok, err
}

// waitAcked polls the socket f on host until it has had at least n bytes
// acknowledged, and returns its TCP_INFO then.
func waitAcked(ctx context.Context, t *testing.T, l *lab.Lab, host string, f tcpflow.Tuple, n uint64) netlink.TCPInfo {
	t.Helper()
	for {
		info, ok, err := tcpInfo(l, host, f)
		if err != nil {
			t.Fatal(err)
		}
		if ok && info.Bytes_acked >= n {
			return info
		}
		select {
		case <-ctx.Done():
			t.Fatalf("socket %v on %s: %d bytes acknowledged (found: %v), want %d: %v", f, host, info.Bytes_acked, ok, n, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// checkSameSegments checks that a restored socket sends segments of the
// size the original did, over the same path MTU, with the same window
// scales and options. Its advmss may be the original's plus the timestamp
// option: a connected socket deducts the option from advmss when the
// SYN-ACK carries timestamps, a repaired one never sees the SYN-ACK.
func checkSameSegments(t *testing.T, original, restored netlink.TCPInfo) {
	t.Helper()
	for _, c := range []struct {
		name               string
		original, restored uint32
	}{
		{"snd_mss (segment size sent)", original.Snd_mss, restored.Snd_mss},
		{"pmtu", original.Pmtu, restored.Pmtu},
		{"snd_wscale", uint32(original.Snd_wscale), uint32(restored.Snd_wscale)},
		{"rcv_wscale", uint32(original.Rcv_wscale), uint32(restored.Rcv_wscale)},
		{"options (timestamps, sack, wscale, ecn)", uint32(original.Options), uint32(restored.Options)},
	} {
		if c.original != c.restored {
			t.Errorf("%s is %d on the restored socket, %d on the original", c.name, c.restored, c.original)
		}
	}
	if a, b := restored.Advmss, original.Advmss; a != b && !(original.Options&1 != 0 /* TCPI_OPT_TIMESTAMPS */ && a == b+12) {
		t.Errorf("advmss is %d on the restored socket, %d on the original", a, b)
	}
}

func describe(i netlink.TCPInfo) string {
	return fmt.Sprintf("snd_mss %d rcv_mss %d advmss %d pmtu %d wscale %d,%d options %#x cwnd %d ssthresh %d rcv_space %d rcv_ssthresh %d",
		i.Snd_mss, i.Rcv_mss, i.Advmss, i.Pmtu, i.Snd_wscale, i.Rcv_wscale, i.Options, i.Snd_cwnd, i.Snd_ssthresh, i.Rcv_space, i.Rcv_ssthresh)
}

// TestRestoredSocketSegmentSize dumps a bulk sender on node1 (CRIU kills
// it, its connection held by CRIU's network lock), crashes node1, restores
// the sender on spare1 as a fail-over does (guard, address take-over,
// initcwnd, LowerPathMTU around CRIU's restore), and checks that the
// restored socket sends segments of the size the original did, with the
// same path MTU, window scales and options. Without LowerPathMTU the
// restored socket's snd_mss is 524 (TCP_MSS_DEFAULT less the timestamp
// option) instead of 1448.
func TestRestoredSocketSegmentSize(t *testing.T) {
	labtest.RequireRoot(t)
	if _, err := os.Stat(criuBin); err != nil {
		t.Fatalf("CRIU 4.2.1 is needed at %s (run `make setup`): %v", criuBin, err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	l := labtest.New(t, 2, 1)
	node1, err := l.Host("node1")
	if err != nil {
		t.Fatal(err)
	}
	node2, err := l.Host("node2")
	if err != nil {
		t.Fatal(err)
	}
	flow := tcpflow.Tuple{Local: netip.AddrPortFrom(node1.Addr.Addr(), 40200), Remote: netip.AddrPortFrom(node2.Addr.Addr(), 7200)}

	sink := streamtest.StartT(t, l, "node2", nil, "bulk-sink", "FTKIT_ADDR="+flow.Remote.String())
	if got := sink.LineT(ctx, t); got != "ready" {
		t.Fatalf("sink said %q", got)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("sockets on spare1:\n%s", sockets(l, "spare1"))
		}
	})

	images := filepath.Join(t.TempDir(), "images")
	if err := os.Mkdir(images, 0o700); err != nil {
		t.Fatal(err)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	// As the agent's shim starts jobs: PID-namespace init and session leader.
	job := exec.Command(exe)
	job.Env = append(os.Environ(), streamtest.RoleEnv+"=bulk-send", "FTKIT_LOCAL="+flow.Local.String(), "FTKIT_PEER="+flow.Remote.String())
	job.Stdin, job.Stdout, job.Stderr = null, null, null
	job.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID, Setsid: true}
	if err := l.Start("node1", job); err != nil {
		t.Fatal(err)
	}
	jobDone := make(chan struct{})
	go func() { job.Wait(); close(jobDone) }()
	t.Cleanup(func() {
		job.Process.Kill()
		<-jobDone
	})

	before := waitAcked(ctx, t, l, "node1", flow, 16<<20)
	t.Logf("original socket: %s", describe(before))

	dumper := streamtest.StartT(t, l, "node1", nil, "criu-dump", fmt.Sprintf("FTKIT_PID=%d", job.Process.Pid), "FTKIT_DIR="+images, "FTKIT_KILL=1")
	t.Logf("job snapshot: %s", dumper.LineT(ctx, t))
	<-jobDone

	if err := l.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	// The relocation recipe on spare1 (see TestRelocateJob); nothing to
	// rewrite: CRIU's network lock froze the connection before the dump.
	imgConns, err := image.TCPConnections(images)
	if err != nil {
		t.Fatal(err)
	}
	if len(imgConns) != 1 || imgConns[0].Tuple != flow {
		t.Fatalf("snapshot connections %+v, want one %v", imgConns, flow)
	}
	ic := imgConns[0]
	conns := []ckpt.Conn{{Tuple: ic.Tuple, Inode: uint64(ic.Inode), InqSeq: ic.InqSeq, InqLen: ic.InqLen,
		OutqSeq: ic.OutqSeq, OutqLen: ic.OutqLen, Timestamp: ic.Timestamp}}
	runID, err := RunID(images)
	if err != nil {
		t.Fatal(err)
	}
	var lowered RouteEdit
	if err := l.Do("spare1", func() error {
		if err := Guard(ctx, runID, conns, nil); err != nil {
			return err
		}
		if err := TakeOver("eth0", node1.Addr); err != nil {
			return err
		}
		if _, err := SetInitCwnd("eth0", MinInitCwnd); err != nil {
			return err
		}
		lowered, err = LowerPathMTU("eth0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	restorer := streamtest.StartT(t, l, "spare1", nil, "criu-restore", "FTKIT_DIR="+images)
	line, err := restorer.Line(ctx)
	if perr := l.Do("spare1", lowered.PutBack); perr != nil {
		t.Error(perr)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Do("spare1", func() error { return Announce(ctx, "eth0", node1.Addr.Addr()) }); err != nil {
		t.Fatal(err)
	}
	t.Logf("restored: %s", line)

	// bytes_acked starts again from 0 on the restored socket. It may have sent 16 MiB already, all before
	// the routes were put back (its peer learns the moved address from spare1's ARP request as well as
	// from the announce): wait for 16 MiB more than it had then, sent after it (ci168 failed so, reading
	// the mss of before the put-back, 1447 over a pmtu of 1499).
	mark, _, err := tcpInfo(l, "spare1", flow)
	if err != nil {
		t.Fatal(err)
	}
	after := waitAcked(ctx, t, l, "spare1", flow, mark.Bytes_acked+16<<20)
	t.Logf("restored socket: %s", describe(after))
	checkSameSegments(t, before, after)
	// The routes are as they were: MTU and advmss metrics gone again.
	if err := l.Do("spare1", func() error {
		link, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		routes, err := netlink.RouteList(link, netlink.FAMILY_ALL)
		if err != nil {
			return err
		}
		for _, r := range routes {
			if r.MTU != 0 || r.AdvMSS != 0 {
				t.Errorf("route %v of eth0 keeps mtu %d advmss %d after the put-back", r.Dst, r.MTU, r.AdvMSS)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}
