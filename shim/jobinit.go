package shim

import (
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/rlimits"
)

// The job's first process is `ftagent shim` in ModeInit mode, started by the shim as root in the job's new
// PID and mount namespaces. It gives the job a /proc of its own PID namespace and then becomes the job
// (exec, as the job's user). Why: CRIU's parasite, which runs inside the job with the job's credentials,
// needs a /proc of the job's PID namespace. If /proc/self does not name the task's own PID it mkdir()s
// "proc.crtools" in the task's working directory and mounts a new proc there: that fails for a job of any
// user but root (EACCES, then EPERM), and for root jobs when two parasites race in the same directory
// (EEXIST). With the job's own /proc at /proc, the parasite takes its fast path and creates nothing.
//
// The job's mount namespace is otherwise a copy of the host's whose mounts are slaves of the host's
// (setupMounts), so the job sees the same files at the same paths. CRIU then dumps that namespace: every
// mount but the job's /proc is a host mount, which CRIU records as external (auto-detected) and binds from
// the restoring host's namespace, so each of them must still exist there. prunedMount drops the copies of the agent's and CRIU's own transient mounts as
// the job starts; the dumping agent leaves out those of host mounts unmounted since (criu/stalemounts), and
// the restoring agent drops those of any mount gone from its host (image.PruneGoneMounts).

// initReport is the descriptor the job's init reports a failure on, as a Report. It is close-on-exec,
// so the shim reads end of file as soon as the job's program runs.
type initReport struct{ f *os.File }

func (r initReport) fail(format string, args ...any) int {
	b, _ := json.Marshal(Report{Error: fmt.Sprintf(format, args...)})
	r.f.Write(append(b, '\n'))
	return 1
}

// runJobInit is the body of the job's init: it returns only if the job could not be started.
func runJobInit(spec Spec) int {
	runtime.LockOSThread() // exec from the thread whose state was set up (credentials are process-wide anyway)
	// Standard output is the shim's report pipe; it makes way for the job's own stdout below.
	fd, err := unix.FcntlInt(1, unix.F_DUPFD_CLOEXEC, 3)
	if err != nil {
		fmt.Fprintf(os.Stderr, "job init: keep the report pipe: %v\n", err)
		return 1
	}
	rep := initReport{os.NewFile(uintptr(fd), "report")}
	if err := setupMounts(); err != nil {
		return rep.fail("set up the job's mount namespace: %v", err)
	}
	null, err := os.Open(os.DevNull)
	if err != nil {
		return rep.fail("%v", err)
	}
	// Opened here, in the job's mount namespace: CRIU finds a file through the mount it was opened on, and
	// the host's mounts are not in the job's namespace.
	// Not O_APPEND: CRIU records no size for O_WRONLY|O_APPEND files (it takes them for logs), and the
	// recovery contract needs the size to truncate back to. The restored offset then equals that size.
	stdout, err := createOutput(spec.Stdout, spec.UID, spec.GID)
	if err != nil {
		return rep.fail("%v", err)
	}
	stderr, err := createOutput(spec.Stderr, spec.UID, spec.GID)
	if err != nil {
		return rep.fail("%v", err)
	}
	env := spec.Env
	if env == nil {
		// Not the agent's own environment: that of a root daemon is nothing a user's job should see.
		env = []string{"PATH=" + defaultPath}
	}
	// What the agent's service unit gave it is not the job's: its OOM score adjustment (the OOM killer would
	// spare the job and kill other users' processes instead) and its raised limits.
	if err := resetOOMScoreAdj(); err != nil {
		return rep.fail("reset the OOM score adjustment: %v", err)
	}
	if err := rlimits.Apply(spec.Limits); err != nil {
		return rep.fail("set the job's resource limits: %v", err)
	}
	// And its umask (UMask=0077): the job's files and directories were 0600 and 0700 where the user's shell
	// makes them 0644 and 0755. Set after the job's output files, which are created with their own mode.
	umask := uint32(defaultUmask)
	if spec.Umask != nil {
		umask = *spec.Umask & 0o777
	}
	unix.Umask(int(umask))
	// As exec.Cmd's Credential did: a job of root keeps root's groups, any other user gets none.
	if spec.UID != 0 {
		if err := syscall.Setgroups(nil); err != nil {
			return rep.fail("drop supplementary groups: %v", err)
		}
		// The set-uid below drops root's permitted, effective and ambient capabilities, not its inheritable
		// ones: the job would keep the agent's, and gain them by running a program with those file
		// capabilities (and a restore refuses a job whose images hold any: agent/creds.go).
		if err := dropInheritable(); err != nil {
			return rep.fail("drop inheritable capabilities: %v", err)
		}
	}
	if err := syscall.Setresgid(int(spec.GID), int(spec.GID), int(spec.GID)); err != nil {
		return rep.fail("set gid %d: %v", spec.GID, err)
	}
	if err := syscall.Setresuid(int(spec.UID), int(spec.UID), int(spec.UID)); err != nil {
		return rep.fail("set uid %d: %v", spec.UID, err)
	}
	if spec.Dir != "" { // with the job's credentials, as exec.Cmd does
		if err := unix.Chdir(spec.Dir); err != nil {
			return rep.fail("chdir %s: %v", spec.Dir, err)
		}
	}
	// With the job's credentials too: as root, the search would look into directories the user cannot
	// (telling the user what they hold) and pick a program there the user cannot run over a later one.
	path, err := lookPath(spec.Argv[0], env, spec.Dir)
	if err != nil {
		return rep.fail("%v", err)
	}
	// What the shim ignores (SIGHUP, SIGINT: cmd/ftagent) stays ignored across exec: the program starts with
	// every signal at its default action, as it would from a login shell.
	if err := defaultSignals(); err != nil {
		return rep.fail("reset the job's signals to their default actions: %v", err)
	}
	for i, f := range []*os.File{null, stdout, stderr} {
		if err := unix.Dup3(int(f.Fd()), i, 0); err != nil {
			return rep.fail("set up descriptor %d: %v", i, err)
		}
	}
	// Nothing else the shim inherited reaches the job: a descriptor opened in the host's mount namespace
	// would also make the job undumpable ("Can't lookup mount=N for fd=M").
	if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return rep.fail("close inherited descriptors: %v", err)
	}
	err = unix.Exec(path, spec.Argv, withoutMPTCP(env))
	return rep.fail("start %s: %v", spec.Argv[0], err)
}

// defaultSignals sets every signal this process ignores (SigIgn in its status) back to its default action.
// A handled signal needs nothing: exec resets it.
func defaultSignals() error {
	const path = "/proc/self/status"
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var ignored uint64
	found := false
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "SigIgn:"); ok {
			if ignored, err = strconv.ParseUint(strings.TrimSpace(v), 16, 64); err != nil {
				return fmt.Errorf("%s: SigIgn: %w", path, err)
			}
			found = true
		}
	}
	if !found {
		return fmt.Errorf("%s has no SigIgn line", path)
	}
	// struct sigaction all zero: SIG_DFL, no flags, an empty mask, whatever the architecture's field order.
	var dfl [8]uint64
	for sig := 1; sig <= 64; sig++ {
		if ignored&(1<<(sig-1)) == 0 {
			continue
		}
		if _, _, errno := unix.RawSyscall6(unix.SYS_RT_SIGACTION, uintptr(sig), uintptr(unsafe.Pointer(&dfl)), 0, 8, 0, 0); errno != 0 {
			return fmt.Errorf("set %s to its default action: %w", unix.SignalName(unix.Signal(sig)), errno)
		}
	}
	return nil
}

// resetOOMScoreAdj raises the process's OOM score adjustment to 0 if it is below (the agent's unit lowers
// the agent's); one above is kept: lowering it needs CAP_SYS_RESOURCE, which a container may not give.
func resetOOMScoreAdj() error {
	const path = "/proc/self/oom_score_adj"
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	adj, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if adj >= 0 {
		return nil
	}
	return os.WriteFile(path, []byte("0"), 0)
}

// defaultUmask is the umask of a job started without one (Spec.Umask): login's default.
const defaultUmask = 0o022

// defaultPath is the PATH of a job started without an environment (login's and sudo's default).
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// withoutMPTCP returns env with multipathtcp=0 added to GODEBUG, unless the job chose multipathtcp itself.
// Why: Go >= 1.24 listens with MPTCP where the kernel has it, and CRIU cannot dump an MPTCP socket ("inet:
// Unsupported proto 262"), so a protected Go server failed its snapshots whenever one caught its listener
// open (seen in CI). With it off, Go listens with TCP, as programs in other languages do.
func withoutMPTCP(env []string) []string {
	out := make([]string, 0, len(env)+1)
	set := false
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "GODEBUG="); ok && !set { // Go takes the first
			set = true
			chosen := slices.ContainsFunc(strings.Split(v, ","), func(s string) bool {
				return strings.HasPrefix(strings.TrimSpace(s), "multipathtcp=")
			})
			switch {
			case chosen:
			case v == "":
				kv = "GODEBUG=multipathtcp=0"
			default:
				kv = "GODEBUG=multipathtcp=0," + v
			}
		}
		out = append(out, kv)
	}
	if !set {
		out = append(out, "GODEBUG=multipathtcp=0")
	}
	return out
}

// setupMounts makes the job's copy of the host's mounts slaves of the host's (nothing it mounts reaches
// the host; what the host mounts and unmounts later reaches the job), drops the copies of mounts that must
// not follow the job, and mounts a /proc of the job's PID namespace. Why slaves: a private copy never saw
// a mount made after the job started, and a path autofs mounts on first access failed inside the job
// ("Too many levels of symbolic links", measured with automount: the daemon mounts in the host's
// namespace). Only mounts the host shares propagate, as systemd shares every mount at boot; on a host
// whose mounts are private the copy stays private, as before.
func setupMounts() error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SLAVE, ""); err != nil {
		return fmt.Errorf("make the job's mounts slaves of the host's: %w", err)
	}
	// Except the directory of named network namespaces, a shared mount on the agent's host
	// (netnsthread.ShareRunDir): a job network made after the job started would propagate into the job's
	// copy, and a snapshot would then name a namespace that is gone where it is restored ("Can't stat
	// mountpoint .../ftj-..."). Namespace handles are pruned below; none may come later.
	if err := unix.Mount("", netnsthread.RunDir, "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil && err != unix.EINVAL && err != unix.ENOENT {
		return fmt.Errorf("make the job's copy of %s private: %w", netnsthread.RunDir, err)
	}
	mounts, err := mountinfo.GetMounts(nil)
	if err != nil {
		return fmt.Errorf("read the job's mounts: %w", err)
	}
	for i := len(mounts) - 1; i >= 0; i-- { // children before their parents
		m := mounts[i]
		if !prunedMount(m) {
			continue
		}
		// EINVAL: already gone with a pruned parent.
		if err := unix.Unmount(m.Mountpoint, unix.MNT_DETACH); err != nil && err != unix.EINVAL && err != unix.ENOENT {
			return fmt.Errorf("unmount the job's copy of %s: %w", m.Mountpoint, err)
		}
	}
	// The host's /proc goes (with anything mounted below it), so that only the job's /proc is left.
	if err := unix.Unmount("/proc", unix.MNT_DETACH); err != nil && err != unix.EINVAL {
		return fmt.Errorf("unmount the host's /proc: %w", err)
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount the job's /proc: %w", err)
	}
	return privateDevpts(mounts)
}

// privateDevpts gives the job a devpts instance of its own at /dev/pts, with the host's options. Why: CRIU
// restores a pseudo-terminal only at the index it had, and on the host's devpts that index can be taken
// on the restoring host (Open MPI's orted gives each rank a pty for its output; measured in CI: "tty:
// Unable to open dev/ptmx with specified index 1"). CRIU restores the job's instance as a new one, where
// every index is free. Programs need nothing: /dev/ptmx opens the instance at the pts beside it (Linux
// >= 4.7). A host without devpts at /dev/pts is left as it is.
func privateDevpts(mounts []*mountinfo.Info) error {
	var host *mountinfo.Info
	for _, m := range mounts {
		if m.Mountpoint == "/dev/pts" && m.FSType == "devpts" {
			host = m // the last one is on top
		}
	}
	if host == nil {
		return nil
	}
	for { // every copy stacked there; EINVAL: /dev/pts is no mount point any more
		if err := unix.Unmount("/dev/pts", unix.MNT_DETACH); err == unix.EINVAL {
			break
		} else if err != nil {
			return fmt.Errorf("unmount the job's copy of the host's /dev/pts: %w", err)
		}
	}
	if err := unix.Mount("devpts", "/dev/pts", "devpts", unix.MS_NOSUID|unix.MS_NOEXEC, host.VFSOptions); err != nil {
		return fmt.Errorf("mount the job's own devpts (options %q): %w", host.VFSOptions, err)
	}
	return nil
}

// prunedMount says whether the job's copy of a host mount is dropped when the job starts. CRIU binds every
// mount of the job's namespace from the restoring host's, so a copy of a mount that has since gone from
// the hosts makes the job unrestorable; measured in the lab: "Can't stat mountpoint .../run/netns/<another
// lab's host>". Dropped: namespace handles (nsfs, such as /run/netns/*, which would also keep another
// host's network namespace alive for as long as the job runs) and CRIU's own transient mounts (the cgroup
// yard and mount-namespace roots of a restore running at that instant, named ".criu.*").
func prunedMount(m *mountinfo.Info) bool {
	return m.FSType == "nsfs" || strings.Contains(m.Mountpoint, "/.criu.")
}

// dropInheritable empties the calling thread's inheritable capability set, keeping the others.
func dropInheritable() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return err
	}
	data[0].Inheritable, data[1].Inheritable = 0, 0
	return unix.Capset(&hdr, &data[0])
}
