package agent

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/jobfs"
	"github.com/ftkit/ftkit/shim"
)

const testUID = 65534

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (files of other users, the agent's ownership checks)")
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// outputsFixture is an agent's layout on disk with one job that wrote past its snapshot: its directory,
// the snapshot's copy of its outputs, a file it writes outside its directory, and root's secret.
type outputsFixture struct {
	a      *Agent
	base   string
	j      Job
	m      *ckpt.Manifest
	home   string // the user's own directory, outside the job directory
	secret string // root's file, which must never change
	work   string // the restore's work directory
}

const secretContent = "root's secret: not to be truncated, overwritten or copied, ever\n"

func lines(from, to int) string {
	var b strings.Builder
	for i := from; i < to; i++ {
		fmt.Fprintln(&b, i)
	}
	return b.String()
}

func newOutputsFixture(t *testing.T) *outputsFixture {
	t.Helper()
	requireRoot(t)
	base := t.TempDir()
	f := &outputsFixture{base: base, home: filepath.Join(base, "home"), secret: filepath.Join(base, "secret")}
	cfg := Config{Name: "n1", StateDir: filepath.Join(base, "state"), JobsDir: filepath.Join(base, "jobs"), CgroupParent: filepath.Join(base, "cg")}
	store, err := ckpt.Open(filepath.Join(cfg.StateDir, "snapshots"), ckpt.Options{Node: "n1"})
	must(t, err)
	f.a = &Agent{cfg: cfg, log: slog.New(slog.NewTextHandler(io.Discard, nil)), store: store}
	l := f.a.layout()
	id := "job-0123abcd"
	f.j = Job{ID: id, UID: testUID, GID: testUID, Dir: l.dir(id), Cgroup: l.cgroup(id), Node: "n0"}
	f.m = &ckpt.Manifest{Job: id, ID: "s1"}
	for _, d := range []string{cfg.JobsDir, f.j.Dir, f.home, filepath.Join(store.Path(id, "s1"), snapOutputs)} {
		must(t, os.MkdirAll(d, 0o755))
	}
	must(t, os.Chown(f.home, testUID, testUID))
	must(t, os.WriteFile(f.secret, []byte(secretContent), 0o600))
	// At the snapshot: stdout had lines 0-9, stderr "e\n", out.log lines 0-4. Since: more of each; stderr
	// is gone (a host without the job directory).
	f.userFile(t, filepath.Join(f.j.Dir, "stdout"), lines(0, 30))
	f.userFile(t, filepath.Join(f.home, "out.log"), lines(0, 20))
	must(t, os.WriteFile(filepath.Join(store.Path(id, "s1"), snapOutputs, "stdout"), []byte(lines(0, 10)), 0o600))
	must(t, os.WriteFile(filepath.Join(store.Path(id, "s1"), snapOutputs, "stderr"), []byte("e\n"), 0o600))
	f.m.OpenFiles = []ckpt.OpenFile{
		{Path: filepath.Join(f.j.Dir, "stdout"), Size: int64(len(lines(0, 10)))},
		{Path: filepath.Join(f.j.Dir, "stderr"), Size: 2},
		{Path: filepath.Join(f.home, "out.log"), Size: int64(len(lines(0, 5)))},
	}
	f.work = filepath.Join(cfg.StateDir, "restore", "w")
	must(t, os.MkdirAll(f.work, 0o700))
	return f
}

func (f *outputsFixture) userFile(t *testing.T, p, content string) {
	t.Helper()
	must(t, os.WriteFile(p, []byte(content), 0o644))
	must(t, os.Chown(p, testUID, testUID))
}

// state is every file the restore may touch, by path ("<missing>" if absent).
func (f *outputsFixture) state() map[string]string {
	out := map[string]string{}
	for _, p := range []string{filepath.Join(f.j.Dir, "stdout"), filepath.Join(f.j.Dir, "stderr"), filepath.Join(f.home, "out.log"), f.secret} {
		// Lstat first: the test must neither follow a planted link nor block on a FIFO.
		st, err := os.Lstat(p)
		switch {
		case err != nil:
			out[p] = "<missing>"
		case st.Mode()&os.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			out[p] = "<link to " + target + ">"
		case !st.Mode().IsRegular():
			out[p] = "<" + st.Mode().String() + ">"
		default:
			b, err := os.ReadFile(p)
			if err != nil {
				out[p] = "<unreadable>"
			}
			out[p] = string(b)
		}
	}
	return out
}

func sameState(t *testing.T, got, want map[string]string) {
	t.Helper()
	for p, w := range want {
		if got[p] != w {
			t.Errorf("%s: %d bytes %q..., want %d bytes as before", p, len(got[p]), head(got[p]), len(w))
		}
	}
}

func head(s string) string {
	if len(s) > 20 {
		return s[:20]
	}
	return s
}

func (f *outputsFixture) restore() (*outputJournal, error) {
	return f.a.restoreOutputs(f.m, f.j, filepath.Join(f.work, outputJournalDir))
}

func TestRestoreOutputsAndUndo(t *testing.T) {
	f := newOutputsFixture(t)
	before := f.state()
	jr, err := f.restore()
	if err != nil {
		t.Fatalf("restore outputs: %v", err)
	}
	after := f.state()
	for p, want := range map[string]string{
		filepath.Join(f.j.Dir, "stdout"): lines(0, 10),
		filepath.Join(f.j.Dir, "stderr"): "e\n",
		filepath.Join(f.home, "out.log"): lines(0, 5),
		f.secret:                         secretContent,
	} {
		if after[p] != want {
			t.Errorf("after restoreOutputs %s is %q, want %q", p, head(after[p]), head(want))
		}
	}
	if st, err := os.Stat(filepath.Join(f.j.Dir, "stderr")); err != nil || st.Sys().(*syscall.Stat_t).Uid != testUID || st.Mode().Perm() != 0o600 {
		t.Errorf("recreated stderr: %v, %v; want 0644 owned by the job's uid", st, err)
	}
	// The journal is private: it holds what the job wrote.
	jdir := filepath.Join(f.work, outputJournalDir)
	if st, err := os.Stat(jdir); err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("journal directory %v, %v; want 0700", st, err)
	}
	saved, _ := filepath.Glob(filepath.Join(jdir, "*"))
	if len(saved) != 2 { // the tails of stdout and out.log
		t.Errorf("journal holds %v, want the two truncated tails", saved)
	}
	for _, p := range saved {
		if st, _ := os.Stat(p); st.Mode().Perm() != 0o600 {
			t.Errorf("%s mode %v, want 0600", p, st.Mode().Perm())
		}
	}
	// The restore failed after all: everything is as it was.
	if err := jr.undo(); err != nil {
		t.Fatalf("undo: %v", err)
	}
	sameState(t, f.state(), before)
}

// A refusal midway undoes what was done before it.
func TestRestoreOutputsRefusalUndoesEarlierChanges(t *testing.T) {
	f := newOutputsFixture(t)
	must(t, os.Symlink(f.secret, filepath.Join(f.home, "planted")))
	f.m.OpenFiles = append(f.m.OpenFiles, ckpt.OpenFile{Path: filepath.Join(f.home, "planted"), Size: 3})
	before := f.state()
	jr, err := f.restore()
	if err == nil || !strings.Contains(err.Error(), filepath.Join(f.home, "planted")) || !errors.Is(err, jobfs.ErrLink) {
		t.Fatalf("restore outputs with a planted link: %v; want a refusal naming it", err)
	}
	if got := f.state()[filepath.Join(f.j.Dir, "stdout")]; got != lines(0, 10) {
		t.Fatalf("stdout was not truncated before the refusal; the test needs it to be")
	}
	if err := jr.undo(); err != nil {
		t.Fatalf("undo: %v", err)
	}
	sameState(t, f.state(), before)
}

// However the job's user arranged its files, root neither follows a link nor changes a file the user
// does not own, and says which file and what to do.
func TestRestoreOutputsNeverWritesThroughLinks(t *testing.T) {
	tests := []struct {
		name  string
		plant func(t *testing.T, f *outputsFixture)
		want  []string // parts of the error
	}{
		{"stdout links to root's file (job directory of an older agent)", func(t *testing.T, f *outputsFixture) {
			f.oldLayout(t)
			p := filepath.Join(f.j.Dir, "stdout")
			must(t, os.Remove(p))
			must(t, os.Symlink(f.secret, p))
		}, []string{"stdout", "symbolic link", "remove it and retry"}},
		{"stderr links to a missing file", func(t *testing.T, f *outputsFixture) {
			f.oldLayout(t)
			must(t, os.Symlink(filepath.Join(f.base, "created-by-root"), filepath.Join(f.j.Dir, "stderr")))
		}, []string{"stderr", "symbolic link"}},
		{"stdout is a hard link to root's file", func(t *testing.T, f *outputsFixture) {
			p := filepath.Join(f.j.Dir, "stdout")
			must(t, os.Remove(p))
			must(t, os.Link(f.secret, p))
		}, []string{"stdout", "owned by another user", "uid 0, not uid 65534"}},
		{"stdout is a FIFO", func(t *testing.T, f *outputsFixture) {
			p := filepath.Join(f.j.Dir, "stdout")
			must(t, os.Remove(p))
			must(t, syscall.Mkfifo(p, 0o666))
			must(t, os.Chown(p, testUID, testUID))
		}, []string{"stdout", "not a regular file"}},
		{"file outside links to root's file", func(t *testing.T, f *outputsFixture) {
			p := filepath.Join(f.home, "out.log")
			must(t, os.Remove(p))
			must(t, os.Symlink(f.secret, p))
		}, []string{"out.log", "symbolic link", "owned by the job's uid 65534"}},
		{"a directory on the way outside is a link", func(t *testing.T, f *outputsFixture) {
			// The user moves its directory away and links its name to root's directory holding an out.log.
			must(t, os.Rename(f.home, f.home+".moved"))
			rootDir := filepath.Join(f.base, "rootdir")
			must(t, os.Mkdir(rootDir, 0o755))
			must(t, os.WriteFile(filepath.Join(rootDir, "out.log"), []byte(secretContent), 0o644))
			must(t, os.Symlink(rootDir, f.home))
			f.secret = filepath.Join(rootDir, "out.log")
		}, []string{"out.log", "symbolic link"}},
		{"file outside is root's", func(t *testing.T, f *outputsFixture) {
			must(t, os.Chown(filepath.Join(f.home, "out.log"), 0, 0))
		}, []string{"out.log", "owned by another user", "truncate it to 10 bytes yourself"}},
		{"file outside is missing", func(t *testing.T, f *outputsFixture) {
			must(t, os.Remove(filepath.Join(f.home, "out.log")))
		}, []string{"out.log", "missing", "does not create it"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newOutputsFixture(t)
			tc.plant(t, f)
			secret, _ := os.ReadFile(f.secret)
			before := f.state()
			jr, err := f.restore()
			if got, _ := os.ReadFile(f.secret); !bytes.Equal(got, secret) {
				t.Errorf("root's file changed: %d bytes %q..., want %d", len(got), head(string(got)), len(secret))
			}
			if err == nil {
				t.Fatal("restoreOutputs succeeded")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
			if jr != nil {
				if err := jr.undo(); err != nil {
					t.Errorf("undo: %v", err)
				}
			}
			if _, err := os.Lstat(filepath.Join(f.base, "created-by-root")); err == nil {
				t.Error("a file was created through a dangling link")
			}
			if _, err := os.Lstat(filepath.Join(f.home, "out.log")); tc.name == "file outside is missing" && err == nil {
				t.Error("a file outside the job directory was created")
			}
			sameState(t, f.state(), before)
			// The directory an older agent handed to the user is root's again.
			if st, err := os.Stat(f.j.Dir); err != nil || st.Sys().(*syscall.Stat_t).Uid != 0 || st.Mode().Perm() != 0o755 {
				t.Errorf("job directory after the restore: %v, %v; want root's, 0755", st, err)
			}
		})
	}
}

// oldLayout gives the job directory to the job's user, as agents before this change did.
func (f *outputsFixture) oldLayout(t *testing.T) {
	must(t, os.Chown(f.j.Dir, testUID, testUID))
}

// finish removes the job's cgroup only if it is this agent's cgroup for the job.
func TestFinishLeavesForeignCgroup(t *testing.T) {
	f := newOutputsFixture(t)
	f.a.jobs = jobStore{dir: filepath.Join(f.a.cfg.StateDir, "jobs")}
	f.a.byID = map[string]*Job{}
	f.a.changed = make(chan struct{})
	must(t, os.MkdirAll(f.a.jobs.dir, 0o755))
	victim := filepath.Join(f.base, "victim")
	must(t, os.Mkdir(victim, 0o755))
	j := f.j
	j.Cgroup = victim
	f.a.finish(&j, JobExited, &shim.ExitStatus{})
	if _, err := os.Stat(victim); err != nil {
		t.Errorf("finish removed %s, which is not the job's cgroup here: %v", victim, err)
	}
	own := f.j
	must(t, os.MkdirAll(own.Cgroup, 0o755))
	f.a.finish(&own, JobExited, &shim.ExitStatus{})
	if _, err := os.Stat(own.Cgroup); err == nil {
		t.Errorf("finish left the job's own cgroup %s", own.Cgroup)
	}
}
