package dump

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/criu/image"
)

const (
	testUID       = 65534
	secretContent = "root's secret: not to be copied into a snapshot, ever\n"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root to own files as another user")
	}
}

// jobDir is a job directory handed to the job's user (as agents before the root-owned layout did), holding
// the job's stdout, and a root-only secret next to it.
func jobDir(t *testing.T) (o Outputs, secret string) {
	t.Helper()
	requireRoot(t)
	base := t.TempDir()
	dir := filepath.Join(base, "job-0123abcd")
	secret = filepath.Join(base, "secret")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, testUID, testUID); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(secret, []byte(secretContent), 0o600); err != nil {
		t.Fatal(err)
	}
	stdout := filepath.Join(dir, "stdout")
	if err := os.WriteFile(stdout, []byte("line 0\nline 1\nmore since the dump\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(stdout, testUID, testUID); err != nil {
		t.Fatal(err)
	}
	return Outputs{Dir: dir, UID: testUID, Own: "stdout and stderr", Name: func(p string) (string, bool) {
		if !strings.HasPrefix(p, dir+"/") {
			return "", false
		}
		if rel := strings.TrimPrefix(p, dir+"/"); rel == "stdout" || rel == "stderr" {
			return rel, true
		}
		return "", true
	}}, secret
}

// copyOutputs copies the job's outputs up to their sizes at the dump, skips files outside the job
// directory, and refuses a written file inside it that is not an output.
func TestCopyOutputs(t *testing.T) {
	o, _ := jobDir(t)
	stdout := filepath.Join(o.Dir, "stdout")
	dst := filepath.Join(t.TempDir(), "outputs")
	files := []ckpt.OpenFile{{Path: stdout, Size: 14}, {Path: stdout, Size: 14}, {Path: "/var/log/elsewhere", Size: 3}}
	if err := copyOutputs("job-0123abcd", o, files, dst); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dst, "stdout"))
	if err != nil || string(b) != "line 0\nline 1\n" {
		t.Errorf("copied stdout %q, %v; want its first 14 bytes", b, err)
	}
	if st, err := os.Stat(filepath.Join(dst, "stdout")); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("copy's mode: %v, %v; want 0600", st, err)
	}
	if ents, _ := os.ReadDir(dst); len(ents) != 1 {
		t.Errorf("outputs directory holds %d files, want only stdout", len(ents))
	}
	err = copyOutputs("job-0123abcd", o, []ckpt.OpenFile{{Path: filepath.Join(o.Dir, "data.bin"), Size: 1}}, filepath.Join(t.TempDir(), "o"))
	if err == nil || !strings.Contains(err.Error(), "data.bin") || !strings.Contains(err.Error(), "stdout and stderr") {
		t.Errorf("a written file in the job directory that is not an output: %v, want a refusal naming it", err)
	}
	err = copyOutputs("job-0123abcd", o, []ckpt.OpenFile{{Path: stdout, Size: 1 << 20}}, filepath.Join(t.TempDir(), "o"))
	if err == nil || !strings.Contains(err.Error(), "shorter") {
		t.Errorf("an output shorter than its size at the dump: %v, want an error", err)
	}
}

// A snapshot copies the job's outputs as root: never root's file behind a link or a hard link.
func TestCopyOutputsRefusesLinks(t *testing.T) {
	for _, plant := range []string{"symlink", "hardlink"} {
		t.Run(plant, func(t *testing.T) {
			o, secret := jobDir(t)
			p := filepath.Join(o.Dir, "stdout")
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			link := os.Symlink
			if plant == "hardlink" {
				link = os.Link
			}
			if err := link(secret, p); err != nil {
				t.Fatal(err)
			}
			dst := filepath.Join(t.TempDir(), "snapshot-outputs")
			err := copyOutputs("job-0123abcd", o, []ckpt.OpenFile{{Path: p, Size: 10}}, dst)
			if err == nil {
				t.Error("copyOutputs copied through a planted " + plant)
			} else if !strings.Contains(err.Error(), p) {
				t.Errorf("error %q does not name %s", err, p)
			}
			if b, err := os.ReadFile(filepath.Join(dst, "stdout")); err == nil && bytes.Contains([]byte(secretContent), b) && len(b) > 0 {
				t.Errorf("root's secret copied into the snapshot: %q", b)
			}
		})
	}
}

func TestWrittenFiles(t *testing.T) {
	files := []image.RegFile{
		{Path: "/j/stdout", Flags: syscall.O_WRONLY | syscall.O_APPEND, Size: 10, HasSize: true},
		{Path: "/j/db", Flags: syscall.O_RDWR, Size: 7, HasSize: true},
		{Path: "/usr/bin/prog", Flags: syscall.O_RDONLY, Size: 99, HasSize: true},
		{Path: "/j/unsized", Flags: syscall.O_WRONLY},
	}
	got := WrittenFiles(files)
	want := []ckpt.OpenFile{{Path: "/j/stdout", Size: 10}, {Path: "/j/db", Size: 7}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("WrittenFiles = %+v, want %+v", got, want)
	}
}

type failingDumper struct{ dir string }

func (d *failingDumper) Dump(_ context.Context, opts criu.DumpOptions) (criu.DumpStats, error) {
	d.dir = opts.ImagesDir
	return criu.DumpStats{}, errors.New("criu: dump failed")
}

// A failed dump leaves nothing in the store: no snapshot, no half-written directory.
func TestTakeAbortsOnFailure(t *testing.T) {
	root := t.TempDir()
	store, err := ckpt.Open(root, ckpt.Options{Node: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	d := &failingDumper{}
	m, err := Take(context.Background(), store, d, Options{Job: "job-0123abcd", PID: 1})
	if err == nil || m != nil {
		t.Fatalf("Take = %v, %v; want the dump's error", m, err)
	}
	if d.dir == "" {
		t.Fatal("the dumper was not called")
	}
	if _, err := os.Stat(d.dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("images directory %s left behind: %v", d.dir, err)
	}
	if ids, err := store.List("job-0123abcd", ""); err != nil || len(ids) != 0 {
		t.Errorf("store lists %v, %v after a failed dump; want nothing", ids, err)
	}
}
