package image

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/lab/labtest"
)

const (
	criuBin   = "/usr/local/sbin/criu"
	helperEnv = "FTKIT_CRIU_IMAGE_HELPER_DIR" // set: this binary runs as the dumped helper
	c2sLen    = 3000                          // bytes the client sends and the server never reads
	s2cLen    = 1000                          // bytes the server sends and the client never reads
	heldLen   = 1234                          // size of the regular file the helper keeps open
)

func TestMain(m *testing.M) {
	if dir := os.Getenv(helperEnv); dir != "" {
		if err := runHelper(dir); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// pattern gives distinct, position-dependent bytes so a misplaced or lost
// byte shows up in comparisons.
func pattern(seed byte, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
	return b
}

type helperReady struct{ ListenPort, ClientPort int }

// runHelper is the process CRIU dumps: a TCP pair over 127.0.0.1 with unread
// bytes queued in both directions and a regular file held open. On SIGUSR1
// (sent after a restore) it reads what is queued on the server side and
// writes it to restored-inq.bin.
func runHelper(dir string) error {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		return err
	}
	client, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		return err
	}
	server, err := ln.Accept()
	if err != nil {
		return err
	}
	ln.Close()
	if _, err := client.Write(pattern(0x11, c2sLen)); err != nil {
		return err
	}
	if _, err := server.Write(pattern(0x22, s2cLen)); err != nil {
		return err
	}
	for _, q := range []struct {
		c    net.Conn
		want int
	}{{server, c2sLen}, {client, s2cLen}} {
		if err := waitInq(q.c.(*net.TCPConn), q.want); err != nil {
			return err
		}
	}
	held, err := os.Create(filepath.Join(dir, "held.dat"))
	if err != nil {
		return err
	}
	if _, err := held.Write(pattern(0x33, heldLen)); err != nil {
		return err
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGUSR1)
	r := helperReady{ListenPort: ln.Addr().(*net.TCPAddr).Port, ClientPort: client.LocalAddr().(*net.TCPAddr).Port}
	if err := writeJSON(filepath.Join(dir, "ready.json"), r); err != nil {
		return err
	}
	// Never outlive a test that died without cleanup.
	giveUp := time.After(60 * time.Second)
	select {
	case <-sig:
	case <-giveUp:
		return errors.New("no SIGUSR1 within 60 s")
	}
	var got []byte
	buf := make([]byte, 64<<10)
	for {
		server.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		n, err := server.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			break
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "restored-inq.tmp"), got, 0o600); err != nil {
		return err
	}
	if err := os.Rename(filepath.Join(dir, "restored-inq.tmp"), filepath.Join(dir, "restored-inq.bin")); err != nil {
		return err
	}
	// Wait to be killed, so the test's cleanup never signals a reused PID.
	<-giveUp
	runtime.KeepAlive(held)
	runtime.KeepAlive(client)
	return nil
}

func waitInq(c *net.TCPConn, want int) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		var n int
		var ierr error
		if err := rc.Control(func(fd uintptr) { n, ierr = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }); err != nil {
			return err
		}
		if ierr != nil {
			return ierr
		}
		if n == want {
			return nil
		}
	}
	return fmt.Errorf("receive queue of %v never reached %d bytes", c.LocalAddr(), want)
}

func writeJSON(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if err := os.WriteFile(path+".tmp", b, 0o600); err != nil {
		return err
	}
	return os.Rename(path+".tmp", path)
}

func waitFile(t *testing.T, path string, timeout time.Duration, why string) []byte {
	t.Helper()
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if b, err := os.ReadFile(path); err == nil {
			return b
		}
	}
	t.Fatalf("%s: %s did not appear within %v", why, path, timeout)
	return nil
}

func runCRIU(t *testing.T, ctx context.Context, nsPath, logPath string, args ...string) time.Duration {
	t.Helper()
	start := time.Now()
	out, err := exec.CommandContext(ctx, "nsenter", append([]string{"--net=" + nsPath, criuBin}, args...)...).CombinedOutput()
	took := time.Since(start)
	if err != nil {
		log, _ := os.ReadFile(logPath)
		t.Fatalf("criu %s: %v\n%s\nlog tail:\n%s", args[0], err, out, tail(log, 3000))
	}
	return took
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// TestRealDumpEditRestore dumps a live TCP pair with CRIU 4.2.1, checks what
// this package reads against what the helper set up, checks that decoding and
// re-encoding CRIU's own images is byte-identical, edits the server socket,
// and restores the edited dump to check the kernel hands the injected bytes
// to the application.
func TestRealDumpEditRestore(t *testing.T) {
	testenv.RequireKernel(t, "a network namespace and CRIU")
	if _, err := os.Stat(criuBin); err != nil {
		t.Fatalf("CRIU 4.2.1 is required at %s (scripts/setup.sh criu): %v", criuBin, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// A one-host lab: its own network namespace (lo up), removed with everything in it when the test ends.
	nsPath, err := labtest.New(t, 1, 0).NetnsPath("node1")
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	imgDir := filepath.Join(work, "img")
	if err := os.Mkdir(imgDir, 0o700); err != nil {
		t.Fatal(err)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	helperLog, err := os.Create(filepath.Join(work, "helper.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer helperLog.Close()
	// nsenter execs the helper in place (no --fork), so cmd's PID is the
	// helper's. Setsid makes it a session and group leader of its own, so
	// CRIU needs no --shell-job (-j) for a session leader outside the dump;
	// stdin is /dev/null, so no tty is involved either. The helper is the
	// init of a PID namespace of its own, as the agent starts jobs: CRIU
	// restores its threads' ids, which in the host's namespace another
	// process can take between the kill and the restore (pid_max 32768 on
	// this machine kind; ci140 failed so, "Unable to create a thread: -17").
	cmd := exec.Command("nsenter", "--net="+nsPath, "--", exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+work)
	cmd.Stdout, cmd.Stderr = helperLog, helperLog
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWPID}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	exited := make(chan struct{}) // closed once the helper is reaped
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-exited })

	var ready helperReady
	if err := json.Unmarshal(waitFile(t, filepath.Join(work, "ready.json"), 10*time.Second, "helper start"), &ready); err != nil {
		t.Fatal(err)
	}

	dumpTook := runCRIU(t, ctx, nsPath, filepath.Join(imgDir, "dump.log"), "dump", "-t", fmt.Sprint(pid),
		"--tcp-established", "--network-lock", "nftables", "-D", imgDir, "--leave-running", "-o", "dump.log", "-v4")
	t.Logf("criu dump --leave-running took %v", dumpTook)

	// What the manifest builder reads.
	conns, err := TCPConnections(imgDir)
	if err != nil {
		t.Fatal(err)
	}
	lo := func(port int) string { return fmt.Sprintf("127.0.0.1:%d", port) }
	byLocal := map[string]TCPConn{}
	for _, c := range conns {
		byLocal[c.Local.String()] = c
	}
	srv, cli := byLocal[lo(ready.ListenPort)], byLocal[lo(ready.ClientPort)]
	if len(conns) != 2 || srv.Remote.String() != lo(ready.ClientPort) || cli.Remote.String() != lo(ready.ListenPort) {
		t.Fatalf("TCPConnections = %+v, want the pair %s <-> %s", conns, lo(ready.ListenPort), lo(ready.ClientPort))
	}
	t.Logf("server socket as read: %+v", srv)
	for _, tc := range []struct {
		name      string
		c, peer   TCPConn
		wantInq   int
		wantBytes []byte
	}{
		{"server", srv, cli, c2sLen, pattern(0x11, c2sLen)},
		{"client", cli, srv, s2cLen, pattern(0x22, s2cLen)},
	} {
		c := tc.c
		if c.State != tcpEstablish || int(c.InqLen) != tc.wantInq || c.OutqLen != 0 || c.UnsqLen != 0 {
			t.Errorf("%s: state %d inq_len %d outq_len %d unsq_len %d, want 1, %d, 0, 0", tc.name, c.State, c.InqLen, c.OutqLen, c.UnsqLen, tc.wantInq)
		}
		// Everything sent was acknowledged, so each side's rcv_nxt is its
		// peer's write_seq.
		if c.InqSeq != tc.peer.OutqSeq {
			t.Errorf("%s: inq_seq %d != peer outq_seq %d", tc.name, c.InqSeq, tc.peer.OutqSeq)
		}
		if !c.HasTimestamp || !c.HasWindow || c.SoSndbuf == 0 || c.SoRcvbuf == 0 || c.MSS == 0 {
			t.Errorf("%s: missing fields: %+v", tc.name, c)
		}
		s, err := readStream(imgDir, c.Inode)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(s.inq, tc.wantBytes) {
			t.Errorf("%s: receive queue in the image differs from the bytes the peer wrote", tc.name)
		}
	}

	files, err := RegularFiles(imgDir)
	if err != nil {
		t.Fatal(err)
	}
	var held *RegFile
	for i := range files {
		if files[i].Path == filepath.Join(work, "held.dat") {
			held = &files[i]
		}
	}
	if held == nil || !held.HasSize || held.Size != heldLen || held.Pos != heldLen {
		t.Errorf("RegularFiles: held.dat = %+v, want size and pos %d (all: %+v)", held, heldLen, files)
	}

	// Round trips of CRIU's own bytes.
	streams, _ := filepath.Glob(filepath.Join(imgDir, "tcp-stream-*.img"))
	if len(streams) != 2 {
		t.Fatalf("found %d tcp-stream images, want 2: %v", len(streams), streams)
	}
	for _, p := range streams {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		s, err := decodeTCPStream(filepath.Base(p), b)
		if err != nil {
			t.Fatal(err)
		}
		out, err := s.encode()
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out, b) {
			t.Errorf("%s: decode+encode is not byte-identical (%d vs %d bytes)", filepath.Base(p), len(out), len(b))
		}
	}
	filesBefore, err := os.ReadFile(filepath.Join(imgDir, filesName))
	if err != nil {
		t.Fatal(err)
	}
	fimg, err := decodeFiles(filesName, filesBefore)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(fimg.encode(), filesBefore) {
		t.Error("files.img: decode+encode is not byte-identical")
	}
	t.Logf("files.img: %d entries, %d bytes; %d regular files", len(fimg.entries), len(filesBefore), len(files))
	// Edits re-marshal an inet socket entry: that must not change its bytes.
	for _, i := range fimg.tcpSockets() {
		b, err := proto.Marshal(fimg.entries[i])
		if err != nil || !bytes.Equal(b, fimg.raw[i]) {
			t.Errorf("files.img entry #%d (socket inode %d): re-marshal differs (err %v)", i, fimg.entries[i].GetIsk().GetIno(), err)
		}
	}

	// Edit the server socket the way a restore would, then restore.
	extra := pattern(0x44, 500)
	start := time.Now()
	err = Apply(imgDir, srv.Inode,
		InjectReceive(extra),
		Timestamp(srv.Timestamp+1001),
		Windows(srv.SndWnd+4096, srv.MaxWindow+4096),
		SendBuffer(4<<20))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Apply of 4 edits to the real images took %v", time.Since(start))
	after, err := TCPConnections(imgDir)
	if err != nil {
		t.Fatal(err)
	}
	var edited TCPConn
	for _, c := range after {
		if c.Inode == srv.Inode {
			edited = c
		}
	}
	want := srv
	want.InqLen += uint32(len(extra))
	want.InqSeq += uint32(len(extra))
	want.RcvWup = want.InqSeq
	want.Timestamp = srv.Timestamp + 1002 // srv.Timestamp is even: CRIU reads ms timestamps with the low bit clear
	want.SndWnd += 4096
	want.MaxWindow += 4096
	want.SoSndbuf = 4 << 20
	if edited != want {
		t.Errorf("after edits:\n got %+v\nwant %+v", edited, want)
	}

	cmd.Process.Kill()
	<-exited
	pidFile := filepath.Join(work, "restored.pid")
	restoreTook := runCRIU(t, ctx, nsPath, filepath.Join(imgDir, "restore.log"), "restore", "-D", imgDir,
		"--tcp-established", "-d", "--pidfile", pidFile, "-o", "restore.log", "-v4")
	t.Logf("criu restore -d took %v", restoreTook)
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	if pid, err = strconv.Atoi(strings.TrimSpace(string(b))); err != nil {
		t.Fatalf("criu restore's pid file: %v", err)
	}
	// The restored helper (PID 1 of a new namespace, pid in ours) is not
	// our child; a pidfd makes sure later signals reach it and never a
	// reused PID. It waits for SIGUSR1 and then to be killed, so it is
	// alive here.
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatalf("pidfd of restored helper %d: %v", pid, err)
	}
	t.Cleanup(func() {
		if err := unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
			t.Errorf("kill restored helper %d: %v", pid, err)
		}
		unix.Close(pidfd)
	})
	if err := unix.PidfdSendSignal(pidfd, unix.SIGUSR1, nil, 0); err != nil {
		t.Fatalf("signal restored helper %d: %v", pid, err)
	}
	got := waitFile(t, filepath.Join(work, "restored-inq.bin"), 10*time.Second, "restored helper reading its socket")
	if wantInq := append(pattern(0x11, c2sLen), extra...); !bytes.Equal(got, wantInq) {
		t.Errorf("restored server read %d bytes, want the %d queued + %d injected in order", len(got), c2sLen, len(extra))
	}
}

func readStream(dir string, inode uint32) (*tcpStream, error) {
	b, err := os.ReadFile(tcpStreamPath(dir, inode))
	if err != nil {
		return nil, err
	}
	return decodeTCPStream(tcpStreamName(inode), b)
}
