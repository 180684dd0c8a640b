// Package shim is the parent of one protected job: `ftagent shim` starts the job (as the init of its own
// PID and mount namespaces, see jobinit.go) or restores it with CRIU, waits for it and records how it ended.
// The agent launches shims (Launch), reads their exit records (ReadExit) and signals their jobs (Signal).
package shim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/internal/heldfiles"
	"github.com/ftkit/ftkit/internal/jobfs"
	"github.com/ftkit/ftkit/internal/rlimits"
	"github.com/ftkit/ftkit/internal/rootpath"
)

// A shim is the parent of one job, like containerd's shim: the agent starts it detached (its own session),
// so the job survives an agent crash and its exit status is still recorded. The shim is a child subreaper,
// and CRIU restores with rst_sibling, so a restored tree becomes the shim's child just like a started one.

// Mode says whether the shim starts a program or restores a snapshot.
type Mode string

const (
	ModeStart   Mode = "start"
	ModeRestore Mode = "restore"
	// ModeInit is internal to a started job: the shim runs itself in this mode as the job's first
	// process, which sets up the job's namespaces and becomes the job (see jobinit.go).
	ModeInit Mode = "init"
)

// Spec is what the agent hands a shim on its standard input.
type Spec struct {
	JobID     string   `json:"job_id"`
	Mode      Mode     `json:"mode"`
	Argv      []string `json:"argv,omitempty"`
	Env       []string `json:"env,omitempty"`
	Dir       string   `json:"dir,omitempty"`
	UID       uint32   `json:"uid"`
	GID       uint32   `json:"gid"`
	Stdout    string   `json:"stdout"`
	Stderr    string   `json:"stderr"`
	Cgroup    string   `json:"cgroup"` // cgroup v2 directory the job runs in (restored into, for ModeRestore)
	ImagesDir string   `json:"images_dir,omitempty"`
	// LazyPages restores the job's memory on first touch, from a lazy-pages daemon the shim runs on
	// ImagesDir; the shim removes ImagesDir once every page is in, and kills the job if the daemon fails.
	LazyPages bool   `json:"lazy_pages,omitempty"`
	CRIU      string `json:"criu,omitempty"`
	ExitFile  string `json:"exit_file"`
	Node      string `json:"node"`
	// Superseded is a file the agent creates before it kills this copy of the job because the job goes on
	// elsewhere (it moved, its host fenced itself or was declared failed): if it exists when the job ends,
	// the end is not recorded, as it is not the job's. Its name is the agent's, in a directory only root
	// may write.
	Superseded string `json:"superseded,omitempty"`
	// Refusal is a file the agent writes, before it kills the job, with why ftkit refused to let this copy
	// run on (a restore that could not reproduce the failure-free run): the exit record carries it as its
	// Reason, so that ftwrap says why the job was killed. Beside Superseded.
	Refusal string `json:"refusal,omitempty"`
	// Limits are the resource limits the job starts with (ModeStart; rlimits.Session if none).
	Limits []rlimits.Limit `json:"limits,omitempty"`
	// Umask is the file mode creation mask the job starts with (ModeStart): that of the program that
	// asked for it; nil: 022, login's default. Not the shim's own: the agent's unit sets UMask=0077.
	Umask *uint32 `json:"umask,omitempty"`
	// Incarnation is the job's incarnation this copy is (agent.Job.Incarnation), which its exit record
	// carries; nil: not given, and the record carries none.
	Incarnation *uint64 `json:"incarnation,omitempty"`
}

// Report is the shim's one line on standard output: the job's host PID, or why it could not start.
type Report struct {
	PID   int    `json:"pid,omitempty"`
	Error string `json:"error,omitempty"`
}

// ExitStatus is how a job ended, written by its shim to the job's exit file.
type ExitStatus struct {
	Code   int       `json:"code"`             // exit code, or 128+signal as shells report it
	Signal string    `json:"signal,omitempty"` // set when the job was killed by a signal
	Time   time.Time `json:"time"`
	Node   string    `json:"node"`
	// Reason is why ftkit killed the job, when it did (Spec.Refusal): its recovery was refused.
	Reason string `json:"reason,omitempty"`
	// Incarnation is the job's incarnation the copy that ended was (Spec.Incarnation); nil in a record of a
	// shim of an older agent. Readers decode records leniently, so an older one ignores it.
	Incarnation *uint64 `json:"incarnation,omitempty"`
}

// Older reports whether st is the record of a copy older than incarnation cur of the job: a superseded
// copy's (fenced, moved, a failed host's) whose shim recorded its kill, not the job's end. A record
// without an incarnation is not known to be older.
func (st *ExitStatus) Older(cur uint64) bool { return st.Incarnation != nil && *st.Incarnation < cur }

// Run is the body of `ftagent shim`: read the spec, start or restore the job, report its PID, wait for
// it and record how it ended. It returns the shim's exit code.
func Run(ctx context.Context, in io.Reader, out io.Writer) int {
	var spec Spec
	report := func(r Report) {
		b, _ := json.Marshal(r)
		out.Write(append(b, '\n'))
		if c, ok := out.(io.Closer); ok {
			c.Close()
		}
	}
	if err := json.NewDecoder(in).Decode(&spec); err != nil {
		report(Report{Error: fmt.Sprintf("read shim spec: %v", err)})
		return 2
	}
	if spec.Mode == ModeInit {
		return runJobInit(spec) // returns only on failure, which it reported
	}
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		report(Report{Error: fmt.Sprintf("become child subreaper: %v", err)})
		return 1
	}
	var pid int
	var err error
	var lazy *exec.Cmd
	switch spec.Mode {
	case ModeStart:
		pid, err = startJob(spec)
	case ModeRestore:
		c := criu.Client{Binary: spec.CRIU}
		// CRIU binds the job's unix sockets and opens its FIFOs by path as root: first, the user must be able to.
		err = checkNames(spec)
		if err == nil {
			// And CRIU binds them, and opens the job's files, as the job's user (patches/0006, 0007): this
			// process restores this one job.
			err = errors.Join(os.Setenv(criu.RestoreUIDEnv, strconv.FormatUint(uint64(spec.UID), 10)),
				os.Setenv(criu.RestoreGIDEnv, strconv.FormatUint(uint64(spec.GID), 10)))
		}
		if err == nil && spec.LazyPages {
			lazy, err = c.StartLazyPages(ctx, spec.ImagesDir)
		}
		if err == nil {
			// CRIU reopens the job's files by path as root: the job must hold only what its user could open.
			restored := func(nsPID int) (*image.Files, error) { return image.TaskFiles(spec.ImagesDir, nsPID) }
			verify := func(pid int) error { return heldfiles.Check(pid, spec.UID, spec.GID, restored) }
			pid, err = c.Restore(ctx, criu.RestoreOptions{ImagesDir: spec.ImagesDir, LazyPages: spec.LazyPages, Cgroup: spec.Cgroup, Verify: verify})
		}
		if err != nil && lazy != nil {
			lazy.Process.Kill()
			lazy.Wait()
		}
	default:
		err = fmt.Errorf("unknown shim mode %q", spec.Mode)
	}
	if err != nil {
		report(Report{Error: err.Error()})
		return 1
	}
	report(Report{PID: pid})
	st := waitRestored(spec, pid, lazy)
	st.Node = spec.Node
	if err := recordEnd(spec, st); err != nil {
		fmt.Fprintf(os.Stderr, "shim: record exit status of job %s: %v\n", spec.JobID, err)
		return 1
	}
	return 0
}

// checkNames checks the paths at which the restore binds the job's unix sockets and opens its FIFOs
// (heldfiles.CheckNames).
func checkNames(spec Spec) error {
	if spec.UID == 0 {
		return nil
	}
	names, err := image.NamedPaths(spec.ImagesDir)
	if err == nil {
		err = heldfiles.CheckNames(spec.UID, spec.GID, names)
	}
	if err != nil {
		return fmt.Errorf("restore from %s: %w", spec.ImagesDir, err)
	}
	return nil
}

// recordEnd writes the job's exit record, unless the agent superseded this copy (Spec.Superseded): ftwrap and
// the agents follow the job through its directory, and a record there says the job is over. A job the agent
// killed carries the agent's reason (Spec.Refusal); every record, the copy's incarnation (Spec.Incarnation),
// for its readers to tell a superseded copy's record from the job's end.
func recordEnd(spec Spec, st ExitStatus) error {
	if spec.Superseded != "" {
		// Only the agent's mark counts: the marks lie beside the job records, in jobs_dir in the default
		// layout, which users may write to (sticky), and one planted there by a user who reads another user's
		// job id in it would have that job's end go unrecorded.
		if fi, err := os.Lstat(spec.Superseded); err == nil && fi.Mode().IsRegular() && rootpath.Trusted(rootpath.Owner(fi)) {
			fmt.Fprintf(os.Stderr, "shim: job %s: this copy was superseded (%s): its end (%d) is not the job's, not recorded\n",
				spec.JobID, spec.Superseded, st.Code)
			return nil
		}
	}
	if spec.Refusal != "" && st.Signal == "SIGKILL" { // a job that ended by itself first ended so
		if r := readRefusal(spec.Refusal); r != "" { // none written: the shim's own reason, if any, stays
			st.Reason = r
		}
	}
	st.Incarnation = spec.Incarnation
	return writeExit(spec.ExitFile, st)
}

// maxRefusal bounds the reason an exit record carries.
const maxRefusal = 4 << 10

// readRefusal returns the agent's reason for killing the job, "" if it wrote none.
func readRefusal(path string) string {
	f, fi, err := openRegular(path, "refusal")
	if err != nil {
		return ""
	}
	if !rootpath.Trusted(rootpath.Owner(fi)) { // another user's, planted as the mark could be (recordEnd)
		f.Close()
		return ""
	}
	defer f.Close()
	b, _ := io.ReadAll(io.LimitReader(f, maxRefusal))
	return strings.ToValidUTF8(strings.TrimSpace(string(b)), "?")
}

// writeExit records how the job ended in its directory: written and renamed inside the directory's own
// descriptor, so that a link in the directory (an older agent's, which the user owns) is replaced, never
// written through.
func writeExit(path string, st ExitStatus) error {
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	dir, err := jobfs.OpenDir(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer dir.Close()
	return dir.WriteFileAtomic(filepath.Base(path), append(b, '\n'), 0o644)
}

// createOutput creates one of the job's output files, which must not exist in any form (a link planted
// there is not followed), and hands it to the job's user.
func createOutput(path string, uid, gid uint32) (*os.File, error) {
	dir, err := jobfs.OpenDir(filepath.Dir(path))
	if err != nil {
		return nil, fmt.Errorf("open job directory: %w", err)
	}
	defer dir.Close()
	f, err := dir.Create(filepath.Base(path), 0o600, uid, gid) // the job's user only: ftwrap reads it with their uid
	if err != nil {
		return nil, fmt.Errorf("create job output (every job gets a new directory, so it cannot exist yet): %w", err)
	}
	return f, nil
}

// startJob starts the program as the init of a new PID namespace (so that its restore never collides with
// PIDs elsewhere) and of a new mount namespace holding a /proc of that PID namespace (so that CRIU's
// parasite can dump it whatever its user: see jobinit.go), leader of a new session (CRIU refuses a session
// leader outside the namespace), in the job's cgroup, with stdin from /dev/null and output written to the
// job's files. The job's first process is this binary in ModeInit mode, as root: it mounts the job's /proc,
// opens the job's files in the job's mount namespace, takes the job's credentials and executes the program.
func startJob(spec Spec) (int, error) {
	if len(spec.Argv) == 0 {
		return 0, errors.New("no program to run")
	}
	cg, err := os.Open(spec.Cgroup)
	if err != nil {
		return 0, fmt.Errorf("open job cgroup: %w", err)
	}
	defer cg.Close()
	initSpec := spec
	initSpec.Mode = ModeInit
	in, err := json.Marshal(initSpec)
	if err != nil {
		return 0, err
	}
	specR, specW, err := os.Pipe()
	if err != nil {
		return 0, err
	}
	defer specR.Close()
	repR, repW, err := os.Pipe()
	if err != nil {
		specW.Close()
		return 0, err
	}
	defer repR.Close()
	cmd := &exec.Cmd{
		// /proc/self/exe: the shim's own binary, whatever path the agent was started from.
		Path: "/proc/self/exe", Args: []string{"ftagent", "shim"},
		Stdin: specR, Stdout: repW, Stderr: os.Stderr, // the shim's log
		SysProcAttr: &syscall.SysProcAttr{
			Cloneflags:  syscall.CLONE_NEWPID | syscall.CLONE_NEWNS,
			Setsid:      true,
			UseCgroupFD: true,
			CgroupFD:    int(cg.Fd()),
		},
	}
	err = cmd.Start()
	repW.Close()
	if err != nil {
		specW.Close()
		return 0, fmt.Errorf("start the job's init: %w", err)
	}
	go func() { // the spec may be larger than a pipe's buffer
		specW.Write(in)
		specW.Close()
	}()
	// The init reports a failure on the pipe; once the program runs, the pipe (close-on-exec) is at its end.
	b, err := io.ReadAll(io.LimitReader(repR, 64<<10))
	if err != nil {
		return 0, fmt.Errorf("read the job init's report: %w", err)
	}
	if len(bytes.TrimSpace(b)) > 0 {
		var r Report
		if err := json.Unmarshal(b, &r); err != nil || r.Error == "" {
			r.Error = fmt.Sprintf("job init failed with an unreadable report %q", b)
		}
		cmd.Process.Kill()
		return 0, errors.New(r.Error)
	}
	return cmd.Process.Pid, nil
}

// lookPath resolves argv[0] with the job's own PATH, relative to its working directory.
func lookPath(name string, env []string, dir string) (string, error) {
	if filepath.IsAbs(name) {
		return name, nil
	}
	if filepath.Base(name) != name { // relative path such as ./prog
		return filepath.Join(dir, name), nil
	}
	pathEnv := ""
	for _, kv := range env {
		if len(kv) > 5 && kv[:5] == "PATH=" {
			pathEnv = kv[5:]
		}
	}
	for _, d := range filepath.SplitList(pathEnv) {
		p := filepath.Join(d, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("program %q not found in the job's PATH %q", name, pathEnv)
}

// lazyDone is what the shim does when the lazy-pages daemon (pid daemon) of the job whose root is pid
// ends: once it has put every page in, the images are no longer needed, and their removal tells the agent
// the job's memory is complete (it snapshots the job only then); if it failed, the pages it did not put in
// would read as zeros, so the job is killed: a loud failure, never a silently wrong run. The kill's reason
// goes to *killedFor, for the exit record to say it: a bare SIGKILL looks like the OOM killer's or a user's.
func lazyDone(spec Spec, pid, daemon int, killedFor *string) func(int, unix.WaitStatus) {
	return func(got int, ws unix.WaitStatus) {
		if got != daemon {
			return
		}
		if ws.Exited() && ws.ExitStatus() == 0 {
			if err := os.RemoveAll(spec.ImagesDir); err != nil {
				fmt.Fprintf(os.Stderr, "shim: remove the images of job %s, all its pages in: %v\n", spec.JobID, err)
			}
			return
		}
		// Its log goes with the images when the agent cleans up after the job: its end goes to the shim's log.
		logTail, _ := os.ReadFile(filepath.Join(spec.ImagesDir, criu.LazyPagesLog))
		logTail = logTail[max(0, len(logTail)-2048):]
		fmt.Fprintf(os.Stderr, "shim: the lazy-pages daemon of job %s failed (status %#x): killing the job, whose missing pages would read as zeros; the daemon's log ends:\n%s\n",
			spec.JobID, uint32(ws), logTail)
		*killedFor = fmt.Sprintf("killed by ftkit: its memory could not be restored (the lazy-pages daemon failed with status %#x; see the shim's log)", uint32(ws))
		unix.Kill(pid, unix.SIGKILL)
	}
}

// waitRestored waits for the job whose root is pid (waitJob) and, if lazy is its lazy-pages daemon, acts on
// the daemon's end (lazyDone). A job that ends before all its pages are in leaves its daemon waiting for a
// tree that is gone: the shim ends it before it records the job's end, on which the agent removes the images
// the daemon reads, and so that no root process outlives the job.
func waitRestored(spec Spec, pid int, lazy *exec.Cmd) ExitStatus {
	if lazy == nil {
		return waitJob(pid, nil)
	}
	var killedFor string // why the shim killed the job, if it did
	done := lazyDone(spec, pid, lazy.Process.Pid, &killedFor)
	daemonReaped := false
	st := waitJob(pid, func(got int, ws unix.WaitStatus) {
		if got == lazy.Process.Pid {
			daemonReaped = true
		}
		done(got, ws)
	})
	// Not once waitJob reaped it: its PID may be another process's by now.
	if !daemonReaped {
		lazy.Process.Kill()
		lazy.Wait()
	}
	if killedFor != "" && st.Signal == "SIGKILL" { // else it ended by itself first
		st.Reason = killedFor
	}
	return st
}

// waitJob reaps children until the job's root exits. As a subreaper the shim may also inherit other
// orphans (a CRIU helper, say); they are reaped and passed to other (if set), and otherwise ignored.
func waitJob(pid int, other func(int, unix.WaitStatus)) ExitStatus {
	for {
		var ws unix.WaitStatus
		got, err := unix.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil { // ECHILD: the job is gone without us seeing it (cannot happen for our own child)
			return ExitStatus{Code: 255, Signal: "lost", Time: time.Now().UTC()}
		}
		if got != pid {
			if other != nil {
				other(got, ws)
			}
			continue
		}
		st := ExitStatus{Time: time.Now().UTC()}
		switch {
		case ws.Exited():
			st.Code = ws.ExitStatus()
		case ws.Signaled():
			st.Code = 128 + int(ws.Signal())
			st.Signal = unix.SignalName(ws.Signal())
		default:
			continue
		}
		return st
	}
}

// openLog opens the shim's log at path for appending, never through a link. The log lies beside the job
// records, in jobs_dir in the default layout, which users may write to (sticky): a file there that is not
// root's (a user's, or a link) was planted for a job whose id the directory shows, and would get CRIU's
// messages about another user's job, or be held open to make the agent believe a shim runs (heldOpen); it
// is replaced by root's own.
func openLog(path string) (*os.File, error) { return rootpath.OpenOwnFile(path, os.O_APPEND) }

// Launch launches `SELF shim` detached from the agent and waits for its report.
func Launch(ctx context.Context, self string, spec Spec, logPath string) (int, error) {
	in, err := json.Marshal(spec)
	if err != nil {
		return 0, err
	}
	logf, err := openLog(logPath)
	if err != nil {
		return 0, fmt.Errorf("open shim log: %w", err)
	}
	defer logf.Close()
	cmd := exec.Command(self, "shim")
	cmd.Stdin = bytes.NewReader(in)
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true} // survives the agent's process group being killed
	// A pipe of our own, not StdoutPipe: Wait, which runs at once to reap the shim, closes a StdoutPipe
	// when the shim exits, and a shim that reports and exits at once (a refused restore) had its report
	// lost: "gave no report: read |0: file already closed".
	stdout, w, err := os.Pipe()
	if err != nil {
		return 0, err
	}
	defer stdout.Close()
	cmd.Stdout = w
	err = cmd.Start()
	w.Close()
	if err != nil {
		return 0, fmt.Errorf("start shim: %w", err)
	}
	go cmd.Wait() // reap the shim when it ends while this agent lives; after a restart, init does
	type result struct {
		r   Report
		err error
	}
	done := make(chan result, 1)
	go func() {
		line, err := bufio.NewReader(stdout).ReadBytes('\n')
		var r Report
		if err == nil {
			err = json.Unmarshal(line, &r)
		}
		done <- result{r, err}
	}()
	select {
	case res := <-done:
		if res.err != nil {
			return 0, fmt.Errorf("shim of job %s gave no report (see %s): %w", spec.JobID, logPath, res.err)
		}
		if res.r.Error != "" {
			return 0, fmt.Errorf("job %s: %s", spec.JobID, res.r.Error)
		}
		return res.r.PID, nil
	case <-ctx.Done():
		cmd.Process.Kill()
		return 0, fmt.Errorf("job %s: %w", spec.JobID, ctx.Err())
	}
}
