package criu

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	gocriu "github.com/checkpoint-restore/go-criu/v7"
	"github.com/checkpoint-restore/go-criu/v7/crit"
	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/ftkit/ftkit/internal/netnsthread"
)

// Client runs CRIU requests with one binary. The caller's thread must already be in the job's network
// namespace: CRIU (criu swrk) is forked from it, and CRIU dumps and restores TCP sockets in the namespace
// it runs in.
type Client struct {
	Binary string
	// CgroupYard, if set, is the host's cgroup yard, which dumps use while it leads to every hierarchy of
	// the host (otherwise CRIU mounts the hierarchies itself, as without one).
	CgroupYard *CgroupYard
	// Raise, if set, is called as a dump begins, and what it returns once CRIU is done: the job is stopped
	// meanwhile, and the agent raises the CPU priority of its session, CRIU's, with it (package autogroup).
	Raise func() (release func())
	// UnlockNetwork, if set, deletes the nftables table (family inet) of CRIU's network lock that a dump
	// killed before its end left, in the calling thread's network namespace; nil: over netlink. Tests fake it.
	UnlockNetwork func(table string) error
}

// DumpOptions are the knobs ftkit uses; everything else is fixed by the design (TCP established
// connections, nftables network lock, a job that is its own session and PID namespace).
type DumpOptions struct {
	PID          int    // host PID of the root of the tree (the job's PID-namespace init)
	ImagesDir    string // empty directory to write the images to
	LeaveRunning bool   // snapshot and keep running (the uncoordinated case)
	// FreezeCgroup is the job's cgroup v2 directory when the caller froze it (semi-coordinated); CRIU
	// then uses the freezer instead of stopping tasks one by one, and leaves the cgroup as it found it.
	FreezeCgroup string
	// Netns, if set, is the path of the job's own network namespace (a job network, package jobnet): CRIU
	// is run inside it, so that it dumps the job's sockets without the namespace itself and takes its
	// network lock there (docs/job-addresses.md, fact c). Empty: the calling thread's namespace.
	Netns string
	// SkipMounts are mount points of the job's namespace CRIU leaves out of the dump (skip-mnt): copies of
	// host mounts the host has since unmounted (package stalemounts). A file of the job open on one of
	// them still fails the dump, naming it.
	SkipMounts []string
}

// DumpStats are CRIU's own measurements of a dump (stats-dump), in microseconds and pages.
type DumpStats struct {
	FreezingUS   uint32 `json:"freezing_us"`
	FrozenUS     uint32 `json:"frozen_us"`
	MemdumpUS    uint32 `json:"memdump_us"`
	MemwriteUS   uint32 `json:"memwrite_us"`
	PagesScanned uint64 `json:"pages_scanned"`
	PagesWritten uint64 `json:"pages_written"`
}

// logFile is written inside the images directory so that a failed dump or restore can be diagnosed later.
const (
	dumpLog    = "dump.log"
	restoreLog = "restore.log"
)

// Dump snapshots the process tree rooted at opts.PID into opts.ImagesDir.
func (c Client) Dump(ctx context.Context, opts DumpOptions) (DumpStats, error) {
	return c.dump(ctx, opts, nil)
}

// dump is Dump with CRIU's notifications sent to nfy (nil: none).
func (c Client) dump(ctx context.Context, opts DumpOptions, nfy gocriu.Notify) (DumpStats, error) {
	dir, err := os.Open(opts.ImagesDir)
	if err != nil {
		return DumpStats{}, fmt.Errorf("open images dir: %w", err)
	}
	defer dir.Close()
	req := &rpc.CriuOpts{
		Pid:            proto.Int32(int32(opts.PID)),
		ImagesDirFd:    proto.Int32(int32(dir.Fd())),
		LogLevel:       proto.Int32(4),
		LogFile:        proto.String(dumpLog),
		LeaveRunning:   proto.Bool(opts.LeaveRunning),
		TcpEstablished: proto.Bool(true),
		NetworkLock:    rpc.CriuNetworkLockMethod_NFTABLES.Enum(),
		FileLocks:      proto.Bool(true),
		ManageCgroups:  proto.Bool(true),
		// A job runs in a mount namespace of its own, a copy of the host's with its own /proc (the agent's
		// shim, shim/jobinit.go): CRIU dumps it, recording every mount it finds in its own namespace (the
		// host's) as external ("mnt[]"), to be bound again from the restoring host's. Only the job's /proc
		// is dumped as a mount. A job in the host's namespace (started by an older agent) dumps as before.
		AutoExtMnt: proto.Bool(true),
		// The job's mounts are slaves of the host's shared ones (shim/jobinit.go): CRIU records each
		// master as external instead of refusing the mount ("unreachable sharing").
		ExtMasters: proto.Bool(true),
	}
	if opts.FreezeCgroup != "" {
		req.FreezeCgroup = proto.String(opts.FreezeCgroup)
	}
	yard, release := c.CgroupYard.forDump()
	if yard != "" {
		req.CgroupYard = proto.String(yard)
	}
	req.SkipMnt = opts.SkipMounts
	if t := timeoutSeconds(ctx); t > 0 {
		req.Timeout = proto.Uint32(t)
	}
	lower := func() {}
	if c.Raise != nil {
		lower = c.Raise()
	}
	// The yard and the raised priority are CRIU's until it ends: another dump must not make the yard again
	// under it.
	defer release()
	defer lower()
	var cr *swrk
	if err := inNetns(opts.Netns, func() (err error) { cr, err = startSwrk(c.Binary, false); return err })(); err != nil {
		return DumpStats{}, fmt.Errorf("criu dump of pid %d: %w", opts.PID, err)
	}
	// A dump whose ctx ends kills CRIU and returns once it is gone: its caller then thaws the job and
	// removes the images directory, which a CRIU left running went on freezing and writing.
	err = cr.do(ctx, func() error { return cr.call(rpc.CriuReqType_DUMP, req, nfy) })
	if err != nil {
		log := filepath.Join(opts.ImagesDir, dumpLog)
		if !errors.Is(err, errOpFailed) {
			// CRIU gave no answer (killed at ctx's end, or it died): it did not unlock the network, nor
			// take the job's sockets out of repair mode.
			err = errors.Join(err, c.unlockLeft(opts, log), releaseRepair(opts.PID))
		}
		return DumpStats{}, dumpError(opts.PID, err, log)
	}
	st, err := crit.GetDumpStats(opts.ImagesDir)
	if err != nil {
		return DumpStats{}, fmt.Errorf("read CRIU dump stats: %w", err)
	}
	return DumpStats{
		FreezingUS: st.GetFreezingTime(), FrozenUS: st.GetFrozenTime(),
		MemdumpUS: st.GetMemdumpTime(), MemwriteUS: st.GetMemwriteTime(),
		PagesScanned: st.GetPagesScanned(), PagesWritten: st.GetPagesWritten(),
	}, nil
}

// RestoreUIDEnv and RestoreGIDEnv, in the environment of a restore's caller (CRIU inherits it), name the
// job's user to CRIU as built with ftkit's patches: it unlinks, binds, chowns and connects the job's named
// unix sockets (patches/0006), opens the job's files and makes, links and removes the copies of its
// deleted ones (patches/0007) as that user, not as root. Unset, or uid 0: as root.
const (
	RestoreUIDEnv = "FTKIT_RESTORE_UID"
	RestoreGIDEnv = "FTKIT_RESTORE_GID"
)

// RestoreOptions describe a restore.
type RestoreOptions struct {
	ImagesDir string
	// LazyPages restores the private anonymous memory on first touch (userfaultfd), served by the
	// lazy-pages daemon StartLazyPages started on ImagesDir: the tree runs before its pages are in.
	LazyPages bool
	// Notify, if set, is told about CRIU's restore stages (the restorer guards the network around them).
	Notify gocriu.Notify
	// LeaveStopped leaves every restored task stopped (SIGSTOP) before it runs any code of its own: the
	// caller continues them.
	LeaveStopped bool
	// Cgroup, if set, is the cgroup v2 directory (absolute path) the tree's root is restored into, its
	// sub-cgroups below it: the restoring host's cgroup for the job, whichever the dumping host used.
	// Unset, CRIU restores into the dumped paths.
	Cgroup string
	// Verify, if set, is called with the restored root's PID once CRIU built the tree and before any of it
	// runs (CRIU's post-restore notification): an error aborts the restore, and CRIU kills the tree.
	Verify func(pid int) error
}

// Restore recreates the tree from opts.ImagesDir as a child of the calling process (CRIU's rst_sibling:
// the caller, a subreaper, can then wait for it) and returns the new host PID of its root.
func (c Client) Restore(ctx context.Context, opts RestoreOptions) (int, error) {
	dir, err := os.Open(opts.ImagesDir)
	if err != nil {
		return 0, fmt.Errorf("open images dir: %w", err)
	}
	defer dir.Close()
	req := &rpc.CriuOpts{
		ImagesDirFd:       proto.Int32(int32(dir.Fd())),
		LogLevel:          proto.Int32(4),
		LogFile:           proto.String(restoreLog),
		TcpEstablished:    proto.Bool(true),
		FileLocks:         proto.Bool(true),
		RstSibling:        proto.Bool(true),
		ManageCgroups:     proto.Bool(true),
		ManageCgroupsMode: rpc.CriuCgMode_SOFT.Enum(),
		// A job's own mount namespace (see Dump) is rebuilt on "/" of this host, its external mounts
		// bound from this host's namespace; snapshots of jobs in the host's namespace ignore both.
		Root:       proto.String("/"),
		AutoExtMnt: proto.Bool(true),
		// A mount that was a slave of a host mount becomes a slave of this host's (see Dump), so the
		// restored job keeps seeing what this host mounts and unmounts.
		ExtMasters: proto.Bool(true),
	}
	if opts.LeaveStopped {
		req.LeaveStopped = proto.Bool(true)
	}
	if opts.Cgroup != "" {
		root, err := restoreCgroupRoot(opts.Cgroup)
		if err != nil {
			return 0, fmt.Errorf("criu restore into cgroup %s: %w", opts.Cgroup, err)
		}
		req.CgRoot = []*rpc.CgroupRoot{root}
	}
	if opts.LazyPages {
		req.LazyPages = proto.Bool(true)
	}
	nfy := &pidNotify{Notify: opts.Notify, verify: opts.Verify}
	if nfy.Notify == nil {
		nfy.Notify = gocriu.NoNotify{}
	}
	// CRIU is killed when ctx ends, or when the caller's thread dies (the agent kills a restore's shim at
	// the restore's deadline): left running, it went on building the job's tree, which nothing then
	// watched, in the cgroup and network its caller was giving back.
	// PR_SET_PDEATHSIG follows the thread that started CRIU, not the process: this goroutine keeps that
	// thread to itself until CRIU is reaped. Unlocked, the runtime ran other goroutines on it, and one that
	// ended locked to it (a check run as the job's user, heldfiles) ended the thread and killed CRIU.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cr, err := startSwrk(c.Binary, true)
	if err != nil {
		return 0, fmt.Errorf("criu restore from %s: %w", opts.ImagesDir, err)
	}
	if err := cr.do(ctx, func() error { return cr.call(rpc.CriuReqType_RESTORE, req, nfy) }); err != nil {
		return 0, fmt.Errorf("criu restore from %s: %w%s", opts.ImagesDir, err, logTail(filepath.Join(opts.ImagesDir, restoreLog)))
	}
	if nfy.pid <= 0 {
		return 0, errors.New("criu restore reported no pid for the restored tree")
	}
	return int(nfy.pid), nil
}

// lazyPagesSocket is where CRIU's lazy-pages daemon listens for the restore, in its work directory.
const lazyPagesSocket = "lazy-pages.socket"

// LazyPagesLog is the daemon's log in the images directory.
const LazyPagesLog = "lazy-pages.log"

// StartLazyPages starts CRIU's lazy-pages daemon on imagesDir, for a restore with LazyPages, and returns
// once it listens. The daemon hands each page to the restored tree on its first touch and pushes the rest
// in the background; it exits 0 once every page is in, non-zero if it failed, which leaves the tree with
// pages that read as zeros: the caller must kill the tree then. The caller reaps the command.
func (c Client) StartLazyPages(ctx context.Context, imagesDir string) (*exec.Cmd, error) {
	sock := filepath.Join(imagesDir, lazyPagesSocket)
	// A daemon of an earlier restore from this directory (the restore tried again once a mount went, whose
	// daemon was killed) left its socket: seen, it said this daemon listened before it did, and the restore
	// connected to a socket nobody listened on, or to none while the daemon made it afresh.
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("remove the socket an earlier criu lazy-pages left: %w", err)
	}
	cmd := exec.Command(c.Binary, "lazy-pages", "--images-dir", imagesDir, "--work-dir", imagesDir, "--log-file", LazyPagesLog)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start criu lazy-pages: %w", err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		if _, err := os.Stat(sock); err == nil {
			return cmd, nil
		}
		// A daemon that failed before it listened says so now, not after the deadline (WNOWAIT: the caller
		// of a daemon that runs reaps it).
		var info unix.Siginfo
		if err := unix.Waitid(unix.P_PID, cmd.Process.Pid, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil); err == nil && info.Signo != 0 {
			cmd.Wait() // its status is in ProcessState
			return nil, fmt.Errorf("criu lazy-pages ended (%v) before it listened on %s%s", cmd.ProcessState, sock, logTail(filepath.Join(imagesDir, LazyPagesLog)))
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			cmd.Process.Kill()
			cmd.Wait()
			return nil, fmt.Errorf("criu lazy-pages did not listen on %s in time%s", sock, logTail(filepath.Join(imagesDir, LazyPagesLog)))
		}
		time.Sleep(time.Millisecond)
	}
}

// pidNotify learns the restored root's PID from CRIU's post-restore notification, and verifies the tree
// there (RestoreOptions.Verify).
type pidNotify struct {
	gocriu.Notify
	verify func(pid int) error
	pid    int32
}

func (n *pidNotify) PostRestore(pid int32) error {
	n.pid = pid
	if n.verify != nil {
		if err := n.verify(int(pid)); err != nil {
			return err
		}
	}
	return n.Notify.PostRestore(pid)
}

// inNetns makes call run on an OS thread inside the network namespace at path (go-criu forks CRIU from the
// calling thread); path "" leaves call as it is.
func inNetns(path string, call func() error) func() error {
	if path == "" {
		return call
	}
	return func() error { return netnsthread.In(path, call) }
}

// criuTimeout is CRIU's own default for its --timeout (DEFAULT_TIMEOUT), in seconds.
const criuTimeout = 10

// timeoutSeconds is CRIU's Timeout option for a request under ctx: ctx's deadline when it is nearer than
// CRIU's default, 0 (the default) otherwise. The option bounds only CRIU's collection of the tasks (their
// freeze), not the request: a deadline minutes away must not let a freeze that hangs keep the job half
// stopped that long (a dump's whole bound is ctx, at which its CRIU is killed).
func timeoutSeconds(ctx context.Context) uint32 {
	dl, ok := ctx.Deadline()
	if !ok {
		return 0
	}
	s := time.Until(dl).Seconds()
	switch {
	case s >= criuTimeout:
		return 0
	case s < 1:
		return 1
	}
	return uint32(s)
}

// ErrInFlight means a dump failed because a listening socket of the tree held a connection the kernel had
// completed and the program had not accepted yet. CRIU cannot dump such a connection, and its
// --skip-in-flight would drop it: the peer's end, established, would meet a reset after a restore. The
// tree runs on; a dump after the program has accepted succeeds.
var ErrInFlight = errors.New("a listening socket holds a connection the job has not accepted yet, which CRIU cannot dump")

// inFlightLine is how CRIU's dump log names such a connection ("inet: In-flight connection (l) for 1f5505").
const inFlightLine = "In-flight connection"

// mountpointGoneLine is how CRIU's restore log names a mount point it did not find while it rebuilt the
// tree's mount namespace ("mnt-v2: Can't stat mountpoint /tmp/.criu.mntns.X/mnt-0000000158/run/m: No such
// file or directory").
const mountpointGoneLine = "Can't stat mountpoint"

// MountpointGone reports whether err, a failed restore with the tail of CRIU's log, failed on a mount point
// that was not there. A mount can go from a host between the pruning of the gone mounts from the images
// (image.PruneGoneMounts) and CRIU's restore; the restore fails before any process of the tree runs.
func MountpointGone(err error) bool {
	return err != nil && strings.Contains(err.Error(), mountpointGoneLine)
}

// dumpError is the error of a failed dump of pid: err, what CRIU's log at path says of it, and
// ErrInFlight when that is the cause.
func dumpError(pid int, err error, path string) error {
	if logHas(path, inFlightLine) {
		err = fmt.Errorf("%w: %w", ErrInFlight, err)
	}
	return fmt.Errorf("criu dump of pid %d: %w%s", pid, err, logTail(path))
}

// benignRlimit is an error CRIU logs at every start without CAP_SYS_RESOURCE (a container's root, as in
// CI) and then goes on with the inherited limit: in a failure's tail it stood where the real error belongs,
// and was taken for the cause (ci140).
const benignRlimit = "rlimit: Can't setup RLIMIT_NOFILE for self"

// logScanner scans the log f line by line, holding one line at a time: at log level 4 CRIU logs each file
// of the job by its name, and a job holding many files makes a log of gigabytes, which the root daemon
// must not hold whole (a job's user can fail a dump at will).
func logScanner(f *os.File) *bufio.Scanner {
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	return sc
}

// logHas reports whether a line of the log at path holds s.
func logHas(path, s string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	for sc := logScanner(f); sc.Scan(); {
		if bytes.Contains(sc.Bytes(), []byte(s)) {
			return true
		}
	}
	return false
}

// logTail returns the last error lines of a CRIU log, for error messages. It holds only what it returns
// (logScanner).
func logTail(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	var lines []string
	var last [3][]byte // the last lines, reused: most lines of a log are not kept
	n := 0
	for sc := logScanner(f); sc.Scan(); n++ {
		l := sc.Bytes()
		last[n%len(last)] = append(last[n%len(last)][:0], l...)
		if bytes.Contains(l, []byte(benignRlimit)) {
			continue
		}
		if bytes.Contains(l, []byte("Error")) || bytes.Contains(l, []byte("error")) {
			lines = append(lines, string(l))
			if len(lines) > 6 {
				lines = lines[1:]
			}
		}
	}
	if len(lines) == 0 {
		// No error logged (CRIU killed, or a failure it reports otherwise): where it stopped.
		for i := max(n-len(last), 0); i < n; i++ {
			lines = append(lines, string(last[i%len(last)]))
		}
		if len(lines) == 0 {
			return " (see " + path + ")"
		}
	}
	// A mapping the restorer could not make: what the log says of it (its file, flags), which the caller
	// may not be able to read later (a lab's directory is gone with it).
	for _, l := range lines {
		if _, rest, ok := strings.Cut(l, "Can't restore "); ok && len(strings.Fields(rest)) > 0 {
			addr := []byte(strings.TrimPrefix(strings.Fields(rest)[0], "0x"))
			var about []string
			if _, err := f.Seek(0, io.SeekStart); err == nil {
				for sc := logScanner(f); sc.Scan() && len(about) < 8; {
					if a := sc.Bytes(); bytes.Contains(a, addr) && !bytes.Contains(a, []byte("Can't restore")) {
						about = append(about, string(a))
					}
				}
			}
			lines = append(lines, about...)
			break
		}
	}
	return "\n  " + strings.Join(lines, "\n  ") + "\n  (full log: " + path + ")"
}
