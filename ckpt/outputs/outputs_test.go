package outputs

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
	base   string
	t      Target
	m      *ckpt.Manifest
	dir    string // the job's directory
	home   string // the user's own directory, outside the job directory
	secret string // root's file, which must never change
	work   string // the restore's work directory
}

// outputName is the agent's rule: stdout and stderr are the job's outputs in its directory.
func outputName(dir, path string) (name string, inside bool) {
	if path != dir && !strings.HasPrefix(path, dir+"/") {
		return "", false
	}
	switch rel := strings.TrimPrefix(path, dir+"/"); rel {
	case "stdout", "stderr":
		return rel, true
	}
	return "", true
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
	jobs := filepath.Join(base, "jobs")
	id := "job-0123abcd"
	f.dir = filepath.Join(jobs, id)
	f.t = Target{
		Job: id, UID: testUID, GID: testUID, JobsDir: jobs,
		Name:     func(path string) (string, bool) { return outputName(f.dir, path) },
		Snapshot: filepath.Join(base, "snapshot", "outputs"),
		Log:      slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	f.m = &ckpt.Manifest{Job: id, ID: "s1"}
	for _, d := range []string{jobs, f.dir, f.home, f.t.Snapshot} {
		must(t, os.MkdirAll(d, 0o755))
	}
	must(t, os.Chown(f.home, testUID, testUID))
	must(t, os.WriteFile(f.secret, []byte(secretContent), 0o600))
	// At the snapshot: stdout had lines 0-9, stderr "e\n", out.log lines 0-4. Since: more of each; stderr
	// is gone (a host without the job directory).
	f.userFile(t, filepath.Join(f.dir, "stdout"), lines(0, 30))
	f.userFile(t, filepath.Join(f.home, "out.log"), lines(0, 20))
	must(t, os.WriteFile(filepath.Join(f.t.Snapshot, "stdout"), []byte(lines(0, 10)), 0o600))
	must(t, os.WriteFile(filepath.Join(f.t.Snapshot, "stderr"), []byte("e\n"), 0o600))
	f.m.OpenFiles = []ckpt.OpenFile{
		{Path: filepath.Join(f.dir, "stdout"), Size: int64(len(lines(0, 10)))},
		{Path: filepath.Join(f.dir, "stderr"), Size: 2},
		{Path: filepath.Join(f.home, "out.log"), Size: int64(len(lines(0, 5)))},
	}
	f.work = filepath.Join(base, "state", "restore", "w")
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
	for _, p := range []string{filepath.Join(f.dir, "stdout"), filepath.Join(f.dir, "stderr"), filepath.Join(f.home, "out.log"), f.secret} {
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

func (f *outputsFixture) restore() (*Journal, error) {
	return Restore(f.m, f.t, filepath.Join(f.work, "output-journal"))
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
		filepath.Join(f.dir, "stdout"):   lines(0, 10),
		filepath.Join(f.dir, "stderr"):   "e\n",
		filepath.Join(f.home, "out.log"): lines(0, 5),
		f.secret:                         secretContent,
	} {
		if after[p] != want {
			t.Errorf("after Restore %s is %q, want %q", p, head(after[p]), head(want))
		}
	}
	if st, err := os.Stat(filepath.Join(f.dir, "stderr")); err != nil || st.Sys().(*syscall.Stat_t).Uid != testUID || st.Mode().Perm() != 0o600 {
		t.Errorf("recreated stderr: %v, %v; want 0644 owned by the job's uid", st, err)
	}
	// The journal is private: it holds what the job wrote.
	jdir := filepath.Join(f.work, "output-journal")
	if st, err := os.Stat(jdir); err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("journal directory %v, %v; want 0700", st, err)
	}
	saved, _ := filepath.Glob(filepath.Join(jdir, "*.bytes"))
	if len(saved) != 2 { // the tails of stdout and out.log
		t.Errorf("journal holds %v, want the two truncated tails", saved)
	}
	for _, p := range saved {
		if st, _ := os.Stat(p); st.Mode().Perm() != 0o600 {
			t.Errorf("%s mode %v, want 0600", p, st.Mode().Perm())
		}
	}
	// The restore failed after all: everything is as it was.
	if err := jr.Undo(); err != nil {
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
	if got := f.state()[filepath.Join(f.dir, "stdout")]; got != lines(0, 10) {
		t.Fatalf("stdout was not truncated before the refusal; the test needs it to be")
	}
	if err := jr.Undo(); err != nil {
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
			p := filepath.Join(f.dir, "stdout")
			must(t, os.Remove(p))
			must(t, os.Symlink(f.secret, p))
		}, []string{"stdout", "symbolic link", "remove it and retry"}},
		{"stderr links to a missing file", func(t *testing.T, f *outputsFixture) {
			f.oldLayout(t)
			must(t, os.Symlink(filepath.Join(f.base, "created-by-root"), filepath.Join(f.dir, "stderr")))
		}, []string{"stderr", "symbolic link"}},
		{"stdout is a hard link to root's file", func(t *testing.T, f *outputsFixture) {
			p := filepath.Join(f.dir, "stdout")
			must(t, os.Remove(p))
			must(t, os.Link(f.secret, p))
		}, []string{"stdout", "owned by another user", "uid 0, not uid 65534"}},
		{"stdout is a FIFO", func(t *testing.T, f *outputsFixture) {
			p := filepath.Join(f.dir, "stdout")
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
				t.Fatal("Restore succeeded")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
			if jr != nil {
				if err := jr.Undo(); err != nil {
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
			if st, err := os.Stat(f.dir); err != nil || st.Sys().(*syscall.Stat_t).Uid != 0 || st.Mode().Perm() != 0o755 {
				t.Errorf("job directory after the restore: %v, %v; want root's, 0755", st, err)
			}
		})
	}
}

// oldLayout gives the job directory to the job's user, as agents before this change did.
func (f *outputsFixture) oldLayout(t *testing.T) {
	must(t, os.Chown(f.dir, testUID, testUID))
}

// Each way a file can differ from its snapshot size: what Restore makes of it, and Undo puts it back.
func TestRestoreCases(t *testing.T) {
	tests := []struct {
		name    string
		arrange func(t *testing.T, f *outputsFixture)
		want    map[string]string // file (relative to base) -> content after Restore
		wantErr string
	}{
		{"sizes as at the snapshot: nothing changes", func(t *testing.T, f *outputsFixture) {
			f.userFile(t, filepath.Join(f.dir, "stdout"), lines(0, 10))
			f.userFile(t, filepath.Join(f.dir, "stderr"), "e\n")
			f.userFile(t, filepath.Join(f.home, "out.log"), lines(0, 5))
		}, map[string]string{"jobs/job-0123abcd/stdout": lines(0, 10), "home/out.log": lines(0, 5)}, ""},
		{"own output shorter: rewritten from the snapshot", func(t *testing.T, f *outputsFixture) {
			f.userFile(t, filepath.Join(f.dir, "stdout"), lines(0, 3))
		}, map[string]string{"jobs/job-0123abcd/stdout": lines(0, 10)}, ""},
		{"job directory missing: created with the outputs", func(t *testing.T, f *outputsFixture) {
			must(t, os.RemoveAll(f.dir))
		}, map[string]string{"jobs/job-0123abcd/stdout": lines(0, 10), "jobs/job-0123abcd/stderr": "e\n"}, ""},
		{"file outside shorter: refused", func(t *testing.T, f *outputsFixture) {
			f.userFile(t, filepath.Join(f.home, "out.log"), lines(0, 2))
		}, nil, "shorter than at the snapshot"},
		{"file in the job directory that is not an output: refused", func(t *testing.T, f *outputsFixture) {
			f.m.OpenFiles = append(f.m.OpenFiles, ckpt.OpenFile{Path: filepath.Join(f.dir, "other"), Size: 1})
		}, nil, "not one of the job's outputs there"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newOutputsFixture(t)
			tc.arrange(t, f)
			_, dirErr := os.Stat(f.dir)
			before := f.state()
			jr, err := f.restore()
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Restore: %v; want an error containing %q", err, tc.wantErr)
				}
			} else if err != nil {
				t.Fatalf("Restore: %v", err)
			}
			for rel, want := range tc.want {
				if got, _ := os.ReadFile(filepath.Join(f.base, rel)); string(got) != want {
					t.Errorf("after Restore %s is %q, want %q", rel, head(string(got)), head(want))
				}
			}
			if err := jr.Undo(); err != nil {
				t.Fatalf("Undo: %v", err)
			}
			sameState(t, f.state(), before)
			if _, err := os.Stat(f.dir); (err == nil) != (dirErr == nil) {
				t.Errorf("job directory after Undo: %v; before Restore: %v", err, dirErr)
			}
		})
	}
}

// An Undo that cannot put a file back reports it and leaves an index of the journal for the operator.
func TestUndoFailureLeavesIndex(t *testing.T) {
	f := newOutputsFixture(t)
	jr, err := f.restore()
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	saved, _ := filepath.Glob(filepath.Join(jr.Dir(), "*.bytes"))
	if len(saved) == 0 {
		t.Fatal("the journal saved nothing; the test needs a truncated file")
	}
	must(t, os.Remove(saved[0]))
	err = jr.Undo()
	if err == nil || !strings.Contains(err.Error(), "put back") {
		t.Fatalf("Undo with a saved file gone: %v; want an error saying what it could not put back", err)
	}
	b, rerr := os.ReadFile(filepath.Join(jr.Dir(), IndexFile))
	if rerr != nil || !strings.Contains(string(b), `"kind": "truncated"`) {
		t.Errorf("%s: %v, %q; want the journal's entries", IndexFile, rerr, b)
	}
	if st, err := os.Stat(filepath.Join(jr.Dir(), IndexFile)); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("%s: %v, %v; want mode 0600", IndexFile, st, err)
	}
}

// A nil journal (Restore failed before making one) has nothing to undo or close.
func TestNilJournal(t *testing.T) {
	var jr *Journal
	if err := jr.Undo(); err != nil {
		t.Errorf("Undo of a nil journal: %v", err)
	}
	jr.Close()
}

// TestSparseOutputsStaySparse: a user's output of 4 GiB that holds a few bytes (seeked into, or `truncate
// -s`) costs a restore, and its undo, what it holds: before, the undo of a truncation, and the rewrite of a
// file from the snapshot's copy, wrote every zero into the user's file system.
func TestSparseOutputsStaySparse(t *testing.T) {
	const size = 4 << 30
	sparse := func(t *testing.T, p string, uid int) {
		t.Helper()
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
		must(t, err)
		defer f.Close()
		_, err = f.WriteAt([]byte(lines(0, 10)), 0)
		must(t, err)
		_, err = f.WriteAt([]byte("tail"), size-4)
		must(t, err)
		must(t, os.Chown(p, uid, uid))
	}
	check := func(t *testing.T, when, p string, wantSize int64, wantTail bool) {
		t.Helper()
		f, err := os.Open(p)
		must(t, err)
		defer f.Close()
		var st syscall.Stat_t
		must(t, syscall.Fstat(int(f.Fd()), &st))
		if st.Size != wantSize || st.Blocks*512 > 1<<20 {
			t.Errorf("%s: %s has %d bytes, %d of them on disk; want %d, most of them holes", when, p, st.Size, st.Blocks*512, wantSize)
		}
		b := make([]byte, len(lines(0, 10)))
		if _, err := f.ReadAt(b, 0); err != nil || string(b) != lines(0, 10) {
			t.Errorf("%s: %s starts with %q, %v", when, p, head(string(b)), err)
		}
		if wantTail {
			b := make([]byte, 4)
			if _, err := f.ReadAt(b, size-4); err != nil || string(b) != "tail" {
				t.Errorf("%s: %s ends with %q, %v; want \"tail\"", when, p, b, err)
			}
		}
	}
	t.Run("truncated, then undone", func(t *testing.T) {
		f := newOutputsFixture(t)
		stdout := filepath.Join(f.dir, "stdout")
		sparse(t, stdout, testUID) // the job seeked far past its snapshot's 10 lines
		jr, err := f.restore()
		must(t, err)
		check(t, "restored", stdout, int64(len(lines(0, 10))), false)
		must(t, jr.Undo())
		check(t, "undone", stdout, size, true)
	})
	t.Run("rewritten from the snapshot, then undone", func(t *testing.T) {
		f := newOutputsFixture(t)
		stdout := filepath.Join(f.dir, "stdout")
		sparse(t, filepath.Join(f.t.Snapshot, "stdout"), 0) // the snapshot's copy keeps its holes
		f.m.OpenFiles[0].Size = size
		f.userFile(t, stdout, lines(0, 3)) // shorter than at the snapshot: rewritten from its copy
		jr, err := f.restore()
		must(t, err)
		check(t, "restored", stdout, size, true)
		must(t, jr.Undo())
		if b, err := os.ReadFile(stdout); err != nil || string(b) != lines(0, 3) {
			t.Errorf("undone: stdout %q, %v; want %q", head(string(b)), err, lines(0, 3))
		}
	})
}

// An agent killed right after Restore cut a file (before the restore succeeded or was undone) leaves
// the journal as it is on disk: it must say, durably, what each saved file holds and where its bytes
// belong, or the bytes cut off the user's outputs are in a file no one can put back.
func TestJournalIndexedBeforeChange(t *testing.T) {
	f := newOutputsFixture(t)
	jr, err := f.restore()
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	// The agent is killed here: no Undo, no Close.
	saved, _ := filepath.Glob(filepath.Join(jr.Dir(), "*.bytes"))
	b, rerr := os.ReadFile(filepath.Join(jr.Dir(), IndexFile))
	if rerr != nil {
		t.Fatalf("journal after a kill holds %v and no %s (%v): nothing says which file's bytes they are", saved, IndexFile, rerr)
	}
	for _, p := range []string{filepath.Join(f.dir, "stdout"), filepath.Join(f.home, "out.log")} {
		if !strings.Contains(string(b), p) {
			t.Errorf("%s does not name %s, which Restore cut: %s", IndexFile, p, b)
		}
	}
}

// TestRecreatedOutputStaysSparse: an output missing on the restoring host (no shared file system) is
// recreated from the snapshot's copy with its holes: before, the recreate copied every byte, so a job that
// seeked far past its stdout's end had root write that many zeros into jobs_dir.
func TestRecreatedOutputStaysSparse(t *testing.T) {
	const size = 64 << 20
	f := newOutputsFixture(t)
	copyPath := filepath.Join(f.t.Snapshot, "stdout")
	c, err := os.OpenFile(copyPath, os.O_WRONLY|os.O_TRUNC, 0o600)
	must(t, err)
	_, err = c.WriteAt([]byte("head\n"), 0)
	must(t, err)
	_, err = c.WriteAt([]byte("tail"), size-4)
	must(t, err)
	must(t, c.Close())
	f.m.OpenFiles[0].Size = size
	stdout := filepath.Join(f.dir, "stdout")
	must(t, os.Remove(stdout)) // a host without the job's directory, or without this file
	jr, err := f.restore()
	must(t, err)
	defer jr.Close()
	b, err := os.ReadFile(stdout)
	must(t, err)
	var st syscall.Stat_t
	must(t, syscall.Stat(stdout, &st))
	if len(b) != size || string(b[:5]) != "head\n" || string(b[size-4:]) != "tail" {
		t.Fatalf("recreated stdout: %d bytes, starting %q; want the snapshot's copy, %d bytes", len(b), head(string(b)), size)
	}
	if st.Blocks*512 > 1<<20 {
		t.Errorf("recreated stdout takes %d bytes of disk for 9 of data; want its holes kept", st.Blocks*512)
	}
}
