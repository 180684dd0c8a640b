//go:build linux

package ebpfprobes

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/streamtest"
)

// threadChurn is the threadchurn child role: FTKIT_THREADS times, a new thread makes a readiness call and
// a receive call (nothing to read) on a loopback TCP connection, then exits; it prints "churned <tids>"
// once they are all gone, then "live <tid>" for one more thread that did the same and stays, and waits for
// stdin to close.
func threadChurn() error {
	n, err := strconv.Atoi(os.Getenv("FTKIT_THREADS"))
	if err != nil {
		return fmt.Errorf("parse FTKIT_THREADS: %w", err)
	}
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		return err
	}
	c, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		return err
	}
	defer c.Close()
	s, err := ln.Accept()
	if err != nil {
		return err
	}
	f, err := s.(*net.TCPConn).File()
	if err != nil {
		return err
	}
	fd := int(f.Fd())
	type looked struct {
		tid int
		err error
	}
	// look runs on a thread of its own: a goroutine that ends locked to its thread ends the thread.
	look := func(out chan<- looked, stay <-chan struct{}) {
		runtime.LockOSThread()
		tid := unix.Gettid()
		_, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 0)
		if err == nil {
			if _, _, rerr := unix.Recvfrom(fd, make([]byte, 1), unix.MSG_DONTWAIT); !errors.Is(rerr, unix.EAGAIN) {
				err = fmt.Errorf("receive on an empty connection: %v, want EAGAIN", rerr)
			}
		}
		out <- looked{tid, err}
		<-stay
	}
	gone := make(chan struct{})
	close(gone)
	var churned []string
	for range n {
		out := make(chan looked)
		go look(out, gone)
		l := <-out
		if l.err != nil {
			return l.err
		}
		if l.tid == os.Getpid() {
			continue // the runtime never ends the main thread
		}
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			if _, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", l.tid)); errors.Is(err, os.ErrNotExist) {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("thread %d did not end", l.tid)
			}
		}
		churned = append(churned, strconv.Itoa(l.tid))
	}
	fmt.Printf("churned %s\n", strings.Join(churned, ","))
	out := make(chan looked)
	go look(out, make(chan struct{}))
	l := <-out
	if l.err != nil {
		return l.err
	}
	fmt.Printf("live %d\n", l.tid)
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n') // closed or a line: either ends the child
	return nil
}

// threadChurnIn is the threadchurn child of threads threads, to start in the cgroup dir. Started here rather
// than by streamtest.Start: the tests need no lab, the host's loopback will do.
func threadChurnIn(ctx context.Context, t *testing.T, dir string, threads int) *exec.Cmd {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cgfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(cgfd) })
	cmd := exec.CommandContext(ctx, exe)
	cmd.Env = append(os.Environ(), streamtest.RoleEnv+"=threadchurn", fmt.Sprintf("FTKIT_THREADS=%d", threads))
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: cgfd}
	return cmd
}

// TestRecvOrderFreesExitedThreads: a job whose threads come and go (a pool, an MPI library's progress
// threads) leaves no position behind for the threads that ended, so the map (65536 entries, shared by the
// host's jobs) never fills with the dead and leaves new threads uncounted; a thread that comes after them is
// counted.
func TestRecvOrderFreesExitedThreads(t *testing.T) {
	requirePrivileges(t)
	parent := streamtest.NewCgroupT(t, "ro-parent")
	job := parent.SubT(t, "job1")
	rec := newRecvOrderT(t, parent.Dir, 64<<10)
	if !rec.Positions() {
		t.Skip("SKIPPED LOUDLY: this kernel cannot attach the positions' programs: receive positions are not recorded")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	const threads = 300
	cmd := threadChurnIn(ctx, t, job.Dir, threads)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		stdin.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("threadchurn child: %v; stderr: %s", err, stderr.String())
		}
	}()
	lines := bufio.NewScanner(stdout)
	line := func(prefix string) string {
		t.Helper()
		if !lines.Scan() {
			t.Fatalf("threadchurn child said nothing more (%v); stderr: %s", lines.Err(), stderr.String())
		}
		rest, ok := strings.CutPrefix(lines.Text(), prefix+" ")
		if !ok {
			t.Fatalf("threadchurn child said %q, want %s", lines.Text(), prefix)
		}
		return rest
	}
	churned := strings.Split(line("churned"), ",")
	live, err := strconv.ParseUint(line("live"), 10, 32)
	if err != nil {
		t.Fatal(err)
	}
	if len(churned) < threads-1 {
		t.Fatalf("%d threads ended, want %d", len(churned), threads)
	}

	counts, err := rec.PollCounts(job.ID)
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for _, tid := range churned {
		n, err := strconv.ParseUint(tid, 10, 32)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := counts[uint32(n)]; ok {
			left = append(left, tid)
		}
	}
	if len(left) > 0 {
		t.Errorf("the positions of %d of %d ended threads are still in the map (%d entries for the job): %v",
			len(left), len(churned), len(counts), left[:min(len(left), 10)])
	}
	if counts[uint32(live)] == 0 {
		t.Errorf("the thread started after the others ended made a readiness call, its count is %d, want >= 1", counts[uint32(live)])
	}
	c, err := rec.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Untracked != 0 {
		t.Errorf("%d readiness calls untracked, want 0", c.Untracked)
	}
}

// TestRecvOrderFullPositionsIsAHole: a thread whose readiness call finds the positions map full (65536
// live threads of the host's jobs) is not counted; its later receive calls would carry counts that pass for
// positions (a replay would stop it at the wrong calls, silently). Its job's record gets a hole instead: the
// call is counted lost to the job, so a replay across it is refused.
func TestRecvOrderFullPositionsIsAHole(t *testing.T) {
	requirePrivileges(t)
	parent := streamtest.NewCgroupT(t, "ro-parent")
	job := parent.SubT(t, "job1")
	rec := newRecvOrderT(t, parent.Dir, 64<<10)
	if !rec.Positions() {
		t.Skip("SKIPPED LOUDLY: this kernel cannot attach the positions' programs: receive positions are not recorded")
	}
	// Filled with the threads of a job that does not exist.
	n := int(rec.objs.Positions.MaxEntries())
	keys, values := make([]recvorderThreadKey, n), make([]recvorderPosition, n)
	for i := range keys {
		keys[i] = recvorderThreadKey{CgroupId: ^uint64(0), Nstid: uint32(i + 1)}
	}
	if got, err := rec.objs.Positions.BatchUpdate(keys, values, nil); err != nil || got != n {
		t.Fatalf("fill the positions map: %d of %d, %v", got, n, err)
	}
	lost0, err := rec.Lost(job.ID)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := threadChurnIn(ctx, t, job.Dir, 0)
	cmd.Stdin = strings.NewReader("") // the child ends once its live thread has polled and received
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "live ") {
		t.Fatalf("threadchurn child: %v: %s", err, out)
	}
	c, err := rec.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Untracked == 0 {
		t.Fatalf("no readiness call untracked with the positions map full (%+v)", c)
	}
	lost, err := rec.Lost(job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if lost == lost0 {
		t.Errorf("%d readiness calls untracked, the job's lost calls still %d: its record has no hole", c.Untracked, lost)
	}
}
