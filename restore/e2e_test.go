//go:build linux

package restore

// End-to-end: a job on node1 exchanges a counter stream with a peer on node2,
// is dumped while the stream runs (leave-running), keeps going for thousands
// of counters, node1 crashes, and the job is moved to spare1 with this
// package and CRIU. The peer checks every counter.

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labtest"
	"github.com/ftkit/ftkit/tcpflow"
)

const criuBin = "/usr/local/sbin/criu"

func TestMain(m *testing.M) {
	streamtest.ChildMain(map[string]func() error{
		"job":          jobRole,
		"peer":         peerRole,
		"criu-dump":    dumpRole,
		"criu-restore": restoreRole,
		"bulk-send":    bulkSendRole,
		"bulk-sink":    bulkSinkRole,
		"inq-holder":   inqHolderRole,
	}, 2*time.Minute)
	os.Exit(m.Run())
}

// The counter stream: each side's i-th 8-byte word is its tag and i, big-endian.
const (
	tagJob  = 0xA1 << 56
	tagPeer = 0xB2 << 56
	// progressEvery: the job writes a progress line every that many counters.
	progressEvery = 256
)

func word(tag, i uint64) uint64 { return tag | i }

// streamBytes is the side's stream from byte offset from to byte offset to.
func streamBytes(tag uint64, from, to uint64) []byte {
	out := make([]byte, 0, to-from)
	var w [8]byte
	for o := from &^ 7; o < to; o += 8 {
		binary.BigEndian.PutUint64(w[:], word(tag, o/8))
		lo, hi := max(o, from)-o, min(o+8, to)-o
		out = append(out, w[lo:hi]...)
	}
	return out
}

// jobRole is the protected job (process A): connect from FTKIT_LOCAL to
// FTKIT_PEER, then for i = 0, 1, ...: send counter i, read the peer's counter
// i and check it; a progress line every progressEvery counters to
// FTKIT_JOBDIR/progress. It writes 8 bytes at a time with Go's default
// TCP_NODELAY, the hardest case for the re-sent range (one segment each).
func jobRole() error {
	local, err := netip.ParseAddrPort(os.Getenv("FTKIT_LOCAL"))
	if err != nil {
		return err
	}
	prog, err := os.OpenFile(filepath.Join(os.Getenv("FTKIT_JOBDIR"), "progress"), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(local)}
	c, err := d.Dial("tcp4", os.Getenv("FTKIT_PEER"))
	if err != nil {
		return err
	}
	var wb, rb [8]byte
	for i := uint64(0); ; i++ {
		binary.BigEndian.PutUint64(wb[:], word(tagJob, i))
		if _, err := c.Write(wb[:]); err != nil {
			return fmt.Errorf("write counter %d: %w", i, err)
		}
		if _, err := io.ReadFull(c, rb[:]); err != nil {
			return fmt.Errorf("read counter %d: %w", i, err)
		}
		if got := binary.BigEndian.Uint64(rb[:]); got != word(tagPeer, i) {
			return fmt.Errorf("counter %d: got %#x from the peer, want %#x", i, got, word(tagPeer, i))
		}
		if (i+1)%progressEvery == 0 {
			if _, err := fmt.Fprintf(prog, "%012d\n", i+1); err != nil {
				return err
			}
		}
	}
}

// peerRole is the surviving peer (process B): listen on FTKIT_ADDR, print
// "ready", accept one connection, print "at 0" and wait. A line "more N" on
// stdin lets it go N counters past where it is, then it prints "at <i>"
// (it has sent and received i counters) and waits again. It sends counter i,
// then reads and checks the job's counter i, at most about 8000 a second.
func peerRole() error {
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
	cmds := make(chan uint64)
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			var n uint64
			if _, err := fmt.Sscanf(sc.Text(), "more %d", &n); err == nil {
				cmds <- n
			}
		}
		close(cmds)
	}()
	var wb, rb [8]byte
	limit := uint64(0)
	for i := uint64(0); ; i++ {
		select {
		case n := <-cmds:
			limit = i + n
		default:
		}
		for i >= limit {
			fmt.Printf("at %d\n", i)
			n, ok := <-cmds
			if !ok {
				return nil
			}
			limit = i + n
		}
		binary.BigEndian.PutUint64(wb[:], word(tagPeer, i))
		if _, err := c.Write(wb[:]); err != nil {
			return fmt.Errorf("write counter %d: %w", i, err)
		}
		if _, err := io.ReadFull(c, rb[:]); err != nil {
			return fmt.Errorf("read counter %d: %w", i, err)
		}
		if got := binary.BigEndian.Uint64(rb[:]); got != word(tagJob, i) {
			fmt.Printf("error counter %d: got %#x, want %#x\n", i, got, word(tagJob, i))
			return fmt.Errorf("counter %d: got %#x from the job, want %#x (gap or duplicate)", i, got, word(tagJob, i))
		}
		if i%8 == 7 {
			time.Sleep(time.Millisecond)
		}
	}
}

// dumpRole dumps FTKIT_PID into FTKIT_DIR and leaves it running (or, with
// FTKIT_KILL=1, lets CRIU kill it, its connections held by CRIU's network
// lock until the restore). It is a
// process of its own in the node's namespace, as the agent is: CRIU must be
// forked from a thread in that namespace.
func dumpRole() error {
	pid, err := strconv.Atoi(os.Getenv("FTKIT_PID"))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	st, err := criu.Client{Binary: criuBin}.Dump(ctx, criu.DumpOptions{PID: pid, ImagesDir: os.Getenv("FTKIT_DIR"), LeaveRunning: os.Getenv("FTKIT_KILL") != "1"})
	if err != nil {
		return err
	}
	fmt.Printf("dumped wall_ms=%d frozen_us=%d\n", time.Since(start).Milliseconds(), st.FrozenUS)
	return nil
}

// restoreRole restores FTKIT_DIR in this namespace, prints "pid <pid>
// ms=<restore time>", and stays the restored tree's parent (a subreaper, as
// the agent's shim), reaping it.
func restoreRole() error {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	pid, err := criu.Client{Binary: criuBin}.Restore(ctx, criu.RestoreOptions{ImagesDir: os.Getenv("FTKIT_DIR")})
	if err != nil {
		return err
	}
	fmt.Printf("pid %d ms=%d\n", pid, time.Since(start).Milliseconds())
	for {
		var ws unix.WaitStatus
		if _, err := unix.Wait4(-1, &ws, 0, nil); errors.Is(err, unix.ECHILD) {
			select {} // killed by the test
		}
	}
}

// peerState waits until the peer's logged flow state has not changed for
// 300 ms (the peer is quiet toward the dead node) and returns it.
func peerState(ctx context.Context, t *testing.T, lg *ebpfprobes.TCPLogger, f tcpflow.Tuple) ebpfprobes.FlowState {
	t.Helper()
	var last ebpfprobes.FlowState
	since := time.Now()
	for {
		s, ok, err := lg.FlowState(f)
		if err != nil {
			t.Fatal(err)
		}
		if s != last {
			last, since = s, time.Now()
		}
		if ok && time.Since(since) >= 300*time.Millisecond {
			return s
		}
		select {
		case <-ctx.Done():
			t.Fatalf("peer's flow state never settled: %+v", last)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// expectAt reads the peer's next line and checks it is "at <n>" with n >= min.
func expectAt(ctx context.Context, t *testing.T, peer *streamtest.Child, min uint64) uint64 {
	t.Helper()
	line := peer.LineT(ctx, t)
	var n uint64
	if _, err := fmt.Sscanf(line, "at %d", &n); err != nil || n < min {
		t.Fatalf("peer said %q, want \"at N\" with N >= %d", line, min)
	}
	return n
}

// sockets is `ss -tinoe` in host's namespace, for failure reports.
func sockets(l *lab.Lab, host string) string {
	var out []byte
	err := l.Do(host, func() error {
		var err error
		out, err = exec.Command("ss", "-tinoe").CombinedOutput()
		return err
	})
	if err != nil {
		return fmt.Sprintf("ss in %s: %v", host, err)
	}
	return string(out)
}

// TestRelocateJob moves a job whose leave-running snapshot is thousands of
// counters behind its peer to a spare host, and checks the stream goes on
// with no gap and no duplicate: the whole recipe of
// criu-tcp-relocation.md, without an agent. The peer's live TCP state
// comes from the eBPF logger on its host, as the agent gets it; the logged
// bytes are rebuilt from the deterministic stream.
func TestRelocateJob(t *testing.T) {
	labtest.RequireRoot(t)
	if _, err := os.Stat(criuBin); err != nil {
		t.Fatalf("CRIU 4.2.1 is needed at %s (run `make setup`): %v", criuBin, err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	l := labtest.New(t, 2, 1)
	host := func(name string) lab.Host {
		h, err := l.Host(name)
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	node1, node2 := host("node1"), host("node2")
	jobAddr := netip.AddrPortFrom(node1.Addr.Addr(), 40100)
	peerAddr := netip.AddrPortFrom(node2.Addr.Addr(), 7100)
	// The peer's flow, logged from before its SYN-ACK so that its ISN is known.
	lg, err := ebpfprobes.NewTCPLogger(ebpfprobes.TCPLoggerOptions{RingBufferSize: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lg.Close() })
	flow := tcpflow.Tuple{Local: peerAddr, Remote: jobAddr}
	if err := lg.ProtectFlow(flow); err != nil {
		t.Fatal(err)
	}
	if err := l.Do("node2", func() error {
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		return lg.Attach(eth0.Attrs().Index)
	}); err != nil {
		t.Fatal(err)
	}

	peer := streamtest.StartT(t, l, "node2", nil, "peer", "FTKIT_ADDR="+peerAddr.String())
	if got := peer.LineT(ctx, t); got != "ready" {
		t.Fatalf("peer said %q", got)
	}
	t.Cleanup(func() { // before the peer is killed
		if t.Failed() {
			t.Logf("sockets on node2:\n%s\nsockets on spare1:\n%s", sockets(l, "node2"), sockets(l, "spare1"))
		}
	})

	// The job: PID-namespace init and session leader, output to files it
	// does not append to, as the agent's shim starts jobs.
	dir := t.TempDir()
	jobDir, images := filepath.Join(dir, "job"), filepath.Join(dir, "images")
	for _, d := range []string{jobDir, images} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	open := func(name string) *os.File {
		f, err := os.OpenFile(filepath.Join(jobDir, name), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	job := exec.Command(exe)
	job.Env = append(os.Environ(), streamtest.RoleEnv+"=job", "FTKIT_LOCAL="+jobAddr.String(), "FTKIT_PEER="+peerAddr.String(), "FTKIT_JOBDIR="+jobDir)
	job.Stdin, job.Stdout, job.Stderr = null, open("stdout"), open("stderr")
	job.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID, Setsid: true}
	if err := l.Start("node1", job); err != nil {
		t.Fatal(err)
	}
	jobDone := make(chan struct{}) // closed once the job is reaped
	go func() { job.Wait(); close(jobDone) }()
	t.Cleanup(func() {
		job.Process.Kill()
		<-jobDone
	})

	expectAt(ctx, t, peer, 0)
	fmt.Fprintln(peer.Stdin, "more 2000")
	expectAt(ctx, t, peer, 2000)

	// Snapshot while the stream runs, then let it run a few thousand more.
	fmt.Fprintln(peer.Stdin, "more 1000000000")
	time.Sleep(50 * time.Millisecond)
	dumper := streamtest.StartT(t, l, "node1", nil, "criu-dump", fmt.Sprintf("FTKIT_PID=%d", job.Process.Pid), "FTKIT_DIR="+images)
	t.Logf("job snapshot: %s", dumper.LineT(ctx, t))
	fmt.Fprintln(peer.Stdin, "more 2000")
	atCrash := expectAt(ctx, t, peer, 2000+2000)

	jobFlow := tcpflow.Tuple{Local: jobAddr, Remote: peerAddr}
	original, ok, err := tcpInfo(l, "node1", jobFlow)
	if err != nil || !ok {
		t.Fatalf("the job's socket on node1: found %v, %v", ok, err)
	}
	t.Logf("original socket: %s", describe(original))

	imgConns, err := image.TCPConnections(images)
	if err != nil {
		t.Fatal(err)
	}
	if len(imgConns) != 1 || imgConns[0].Local != jobAddr || imgConns[0].Remote != peerAddr {
		t.Fatalf("snapshot connections %+v, want one %v->%v", imgConns, jobAddr, peerAddr)
	}
	ic := imgConns[0]
	conns := []ckpt.Conn{{Tuple: ic.Tuple, Inode: uint64(ic.Inode), InqSeq: ic.InqSeq, InqLen: ic.InqLen,
		OutqSeq: ic.OutqSeq, OutqLen: ic.OutqLen, Timestamp: ic.Timestamp}}
	t.Logf("snapshot socket: inq %d+%d outq %d+%d (unsent %d) snd_wnd %d max_window %d sndbuf %d ts %d mss %d",
		ic.InqSeq, ic.InqLen, ic.OutqSeq, ic.OutqLen, ic.UnsqLen, ic.SndWnd, ic.MaxWindow, ic.SoSndbuf, ic.Timestamp, ic.MSS)

	if err := l.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	<-jobDone
	crashed := time.Now()

	// What the peer's agent would report.
	live := peerState(ctx, t, lg, flow)
	age, err := live.Age()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("peer state %+v, age %v", live, age)
	if !live.HasISN {
		t.Fatal("the logger did not see the peer's SYN-ACK: cannot place the stream")
	}
	if sent, _ := live.PayloadSent(); uint64(sent) != 8*atCrash {
		t.Fatalf("logger says the peer sent %d bytes, the peer says %d counters (%d bytes)", sent, atCrash, 8*atCrash)
	}
	from := uint64(ic.InqSeq - live.ISN - 1) // peer's stream offset of the snapshot's receive point
	p := Peer{Live: live, LiveAge: age, Logged: streamBytes(tagPeer, from, 8*atCrash)}
	plan, err := NewPlan(conns, map[tcpflow.Tuple]Peer{conns[0].Tuple: p}, 8) // the job writes 8-byte messages
	if err != nil {
		t.Fatal(err)
	}
	cp := plan.Conns[0]
	t.Logf("plan: inject %d bytes, resend %d bytes, timestamp %d (snapshot %d), initcwnd %d, snd_wnd >= %d, sndbuf >= %d",
		len(cp.Inject), cp.Resend, cp.Timestamp, ic.Timestamp, plan.InitCwnd, cp.SndWnd, cp.SndBuf)
	if cp.Resend < 8*1000 || len(cp.Inject) < 8*1000 {
		t.Errorf("the snapshot is only %d/%d bytes behind the peer: the test means thousands of counters", cp.Resend, len(cp.Inject))
	}

	// The recovery contract for the job's own files: back to their size at the snapshot.
	files, err := image.RegularFiles(images)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if f.HasSize && strings.HasPrefix(f.Path, jobDir+"/") {
			if err := os.Truncate(f.Path, int64(f.Size)); err != nil {
				t.Fatal(err)
			}
		}
	}

	start := time.Now()
	if err := Rewrite(images, plan); err != nil {
		t.Fatal(err)
	}
	runID, err := RunID(images)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Do("spare1", func() error {
		if err := Guard(ctx, runID, conns, nil); err != nil {
			return err
		}
		if err := TakeOver("eth0", node1.Addr); err != nil {
			return err
		}
		_, err := SetInitCwnd("eth0", plan.InitCwnd)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var lowered RouteEdit
	if err := l.Do("spare1", func() (err error) { lowered, err = LowerPathMTU("eth0"); return err }); err != nil {
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
	t.Logf("restored: %s", line)
	if err := l.Do("spare1", func() error { return Announce(ctx, "eth0", node1.Addr.Addr()) }); err != nil {
		t.Fatal(err)
	}
	t.Logf("relocation took %v (%v since the crash)", time.Since(start), time.Since(crashed))
	var guarded bool
	if err := l.Do("spare1", func() (err error) { guarded, err = GuardExists(ctx, runID); return err }); err != nil {
		t.Fatal(err)
	}
	if guarded {
		t.Errorf("guard table inet %s still exists after the restore: CRIU did not delete it", GuardTable(runID))
	}

	// The stream goes on: the peer checks every counter.
	resumed := time.Now()
	fmt.Fprintln(peer.Stdin, "more 3000")
	end := expectAt(ctx, t, peer, atCrash+3000)
	t.Logf("peer went from %d to %d counters after the restore in %v, no gap, no duplicate", atCrash, end, time.Since(resumed))
	t.Logf("restored socket on spare1:\n%s", sockets(l, "spare1"))
	// It sends full-size segments again (LowerPathMTU), as the original did.
	restored, ok, err := tcpInfo(l, "spare1", jobFlow)
	if err != nil || !ok {
		t.Fatalf("the restored socket on spare1: found %v, %v", ok, err)
	}
	t.Logf("restored socket: %s", describe(restored))
	checkSameSegments(t, original, restored)

	// The restored job's progress file continues where the snapshot left it.
	b, err := os.ReadFile(filepath.Join(jobDir, "progress"))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Fields(string(b))
	for i, line := range lines {
		if n, err := strconv.Atoi(line); err != nil || n != (i+1)*progressEvery {
			t.Fatalf("progress line %d is %q, want %d", i+1, line, (i+1)*progressEvery)
		}
	}
	if uint64(len(lines)*progressEvery) < atCrash+3000-progressEvery {
		t.Errorf("progress file ends at %d counters, the peer is at %d", len(lines)*progressEvery, end)
	}
	if c, err := lg.Counters(); err != nil || c.DropsBackpressure != 0 {
		t.Errorf("logger counters %+v, %v: it dropped segments", c, err)
	}
}
