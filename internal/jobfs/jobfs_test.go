package jobfs

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

const nobody = 65534

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (files owned by other users, hard links to root's files)")
	}
}

// layout builds a directory as a job's user might leave it, next to root's precious file outside it.
func layout(t *testing.T) (dir, secret string) {
	t.Helper()
	base := t.TempDir()
	dir = filepath.Join(base, "job")
	secret = filepath.Join(base, "secret")
	must(t, os.Mkdir(dir, 0o755))
	must(t, os.WriteFile(secret, []byte("root's secret\n"), 0o600))
	must(t, os.WriteFile(filepath.Join(dir, "stdout"), []byte("output\n"), 0o644))
	must(t, os.Chown(filepath.Join(dir, "stdout"), nobody, nobody))
	must(t, os.Symlink(secret, filepath.Join(dir, "leaf-link")))
	must(t, os.Symlink(filepath.Join(base, "nowhere"), filepath.Join(dir, "dangling")))
	must(t, os.Mkdir(filepath.Join(base, "elsewhere"), 0o755))
	must(t, os.WriteFile(filepath.Join(base, "elsewhere", "stdout"), []byte("elsewhere\n"), 0o644))
	must(t, os.Chown(filepath.Join(base, "elsewhere", "stdout"), nobody, nobody))
	must(t, os.Symlink(filepath.Join(base, "elsewhere"), filepath.Join(dir, "sub")))
	must(t, os.Link(secret, filepath.Join(dir, "hardlink")))
	must(t, syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o666))
	must(t, os.Chown(filepath.Join(dir, "fifo"), nobody, nobody))
	must(t, os.Mkdir(filepath.Join(dir, "subdir"), 0o755))
	return dir, secret
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestOpenOwnedRefusesLinksAndForeignFiles(t *testing.T) {
	requireRoot(t)
	dir, secret := layout(t)
	d, err := OpenDir(dir)
	must(t, err)
	defer d.Close()
	for _, tc := range []struct {
		name string
		want error // nil: opens
	}{
		{"stdout", nil},
		{"leaf-link", ErrLink},
		{"dangling", ErrLink},
		{"sub/stdout", ErrLink}, // a link in a parent component, to a file the user owns
		{"hardlink", ErrNotOwned},
		{"fifo", ErrNotRegular}, // O_PATH first: opening a FIFO for writing would block
		{"subdir", ErrNotRegular},
		{"../secret", ErrEscape},
		{"missing", fs.ErrNotExist},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := d.OpenOwned(tc.name, os.O_RDWR, nobody)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("open: %v", err)
				}
				defer f.Close()
				b, _ := io.ReadAll(f)
				if string(b) != "output\n" {
					t.Errorf("read %q", b)
				}
				return
			}
			if err == nil {
				f.Close()
				t.Fatalf("opened; want %v", tc.want)
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want %v", err, tc.want)
			}
			if want := filepath.Join(dir, tc.name); !bytes.Contains([]byte(err.Error()), []byte(want)) {
				t.Errorf("error %q does not name %s", err, want)
			}
		})
	}
	if b, _ := os.ReadFile(secret); string(b) != "root's secret\n" {
		t.Errorf("secret changed: %q", b)
	}
}

// Open (for root's own trees) still refuses links, but not another owner.
func TestOpenAnyOwner(t *testing.T) {
	requireRoot(t)
	dir, _ := layout(t)
	d, err := OpenDir(dir)
	must(t, err)
	defer d.Close()
	f, err := d.Open("hardlink")
	if err != nil {
		t.Fatalf("open root's file: %v", err)
	}
	f.Close()
	if _, err := d.Open("leaf-link"); !errors.Is(err, ErrLink) {
		t.Errorf("open a link: %v, want ErrLink", err)
	}
	if _, err := d.OpenOwned("stdout", os.O_RDWR|os.O_TRUNC, nobody); err == nil {
		t.Error("O_TRUNC accepted: truncation must happen after the checks, on the descriptor")
	}
}

func TestOpenAbsoluteFromRoot(t *testing.T) {
	requireRoot(t)
	dir, _ := layout(t)
	root, err := OpenRoot()
	must(t, err)
	defer root.Close()
	for _, tc := range []struct {
		path string
		want error
	}{
		{filepath.Join(dir, "stdout"), nil},
		{filepath.Join(dir, "leaf-link"), ErrLink},
		{filepath.Join(dir, "sub", "stdout"), ErrLink},
		{filepath.Join(dir, "hardlink"), ErrNotOwned},
	} {
		rel, ok := root.Rel(tc.path)
		if !ok {
			t.Fatalf("Rel(%s) refused", tc.path)
		}
		f, err := root.OpenOwned(rel, os.O_WRONLY, nobody)
		if f != nil {
			f.Close()
		}
		if (tc.want == nil) != (err == nil) || tc.want != nil && !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.path, err, tc.want)
		}
	}
	// The path to a job directory may itself pass through a link (the administrator's); a tree under a
	// user-controlled link is refused all the same when reached from "/".
	if _, ok := root.Rel("relative/path"); ok {
		t.Error("Rel accepted a relative path")
	}
	if _, ok := root.Rel("/a/../b"); ok {
		t.Error("Rel accepted an unclean path")
	}
}

func TestCreateNeverFollows(t *testing.T) {
	requireRoot(t)
	dir, secret := layout(t)
	d, err := OpenDir(dir)
	must(t, err)
	defer d.Close()
	for _, name := range []string{"leaf-link", "dangling", "stdout", "sub/new"} {
		if f, err := d.Create(name, 0o644, nobody, nobody); err == nil {
			f.Close()
			t.Errorf("create %s succeeded", name)
		}
	}
	if _, err := os.Lstat(filepath.Join(filepath.Dir(dir), "nowhere")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the dangling link's target was created: %v", err)
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(dir), "elsewhere", "new")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a file was created through a link in a parent component: %v", err)
	}
	if b, _ := os.ReadFile(secret); string(b) != "root's secret\n" {
		t.Errorf("secret changed: %q", b)
	}
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	f, err := d.Create("fresh", 0o644, nobody, nobody)
	must(t, err)
	f.Close()
	st, err := os.Lstat(filepath.Join(dir, "fresh"))
	must(t, err)
	if st.Mode() != 0o644 || st.Sys().(*syscall.Stat_t).Uid != nobody || st.Sys().(*syscall.Stat_t).Gid != nobody {
		t.Errorf("created %v uid %d gid %d, want 0644 owned by %d:%d", st.Mode(), st.Sys().(*syscall.Stat_t).Uid, st.Sys().(*syscall.Stat_t).Gid, nobody, nobody)
	}
	sub, err := d.Mkdir("made", 0o755)
	must(t, err)
	sub.Close()
	if st, _ := os.Stat(filepath.Join(dir, "made")); st.Mode().Perm() != 0o755 {
		t.Errorf("mkdir mode %v despite the umask, want 0755", st.Mode().Perm())
	}
	if _, err := d.Mkdir("leaf-link", 0o755); err == nil {
		t.Error("mkdir over a link succeeded")
	}
}

func TestWriteFileAtomicReplacesLinkWithoutFollowing(t *testing.T) {
	requireRoot(t)
	dir, secret := layout(t)
	d, err := OpenDir(dir)
	must(t, err)
	defer d.Close()
	must(t, d.WriteFileAtomic("leaf-link", []byte("record\n"), 0o644))
	st, err := os.Lstat(filepath.Join(dir, "leaf-link"))
	must(t, err)
	if !st.Mode().IsRegular() {
		t.Errorf("after the write the name is %v, want a regular file", st.Mode())
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "leaf-link")); string(b) != "record\n" {
		t.Errorf("content %q", b)
	}
	if b, _ := os.ReadFile(secret); string(b) != "root's secret\n" {
		t.Errorf("secret changed: %q", b)
	}
	entries, _ := filepath.Glob(filepath.Join(dir, ".*tmp-*"))
	if len(entries) != 0 {
		t.Errorf("temporary files left: %v", entries)
	}
	if err := d.WriteFileAtomic("sub/x", nil, 0o644); err == nil {
		t.Error("write through a directory part accepted")
	}
}

func TestOpenDirRefusesLink(t *testing.T) {
	requireRoot(t)
	dir, _ := layout(t)
	if _, err := OpenDir(filepath.Join(dir, "sub")); !errors.Is(err, ErrLink) {
		t.Errorf("OpenDir of a link: %v, want ErrLink", err)
	}
	d, err := OpenDir(dir)
	must(t, err)
	defer d.Close()
	if _, err := d.OpenDir("sub"); !errors.Is(err, ErrLink) {
		t.Errorf("Dir.OpenDir of a link: %v, want ErrLink", err)
	}
}

func TestRemoveFileOnlyIfStillOurs(t *testing.T) {
	requireRoot(t)
	dir, _ := layout(t)
	d, err := OpenDir(dir)
	must(t, err)
	defer d.Close()
	f, err := d.Create("made", 0o644, nobody, nobody)
	must(t, err)
	defer f.Close()
	// The user swaps the name for something else: it is left alone.
	must(t, os.Rename(filepath.Join(dir, "made"), filepath.Join(dir, "moved")))
	must(t, os.Symlink("/etc/passwd", filepath.Join(dir, "made")))
	if err := d.RemoveFile("made", f); err == nil {
		t.Error("removed a name that no longer is the created file")
	}
	must(t, os.Remove(filepath.Join(dir, "made")))
	must(t, os.Rename(filepath.Join(dir, "moved"), filepath.Join(dir, "made")))
	if err := d.RemoveFile("made", f); err != nil {
		t.Errorf("remove the created file: %v", err)
	}
}

// Rename and Remove act on a link as itself: the file it points to keeps its name and content.
func TestRenameAndRemoveNeverFollow(t *testing.T) {
	requireRoot(t)
	dir, _ := layout(t)
	target := filepath.Join(t.TempDir(), "roots")
	must(t, os.WriteFile(target, []byte("root's"), 0o600))
	must(t, os.Symlink(target, filepath.Join(dir, "exit")))
	d, err := OpenDir(dir)
	must(t, err)
	defer d.Close()
	must(t, d.Rename("exit", ".exit-prev"))
	if fi, err := os.Lstat(filepath.Join(dir, ".exit-prev")); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("after Rename, .exit-prev is %v, %v; want the link itself", fi, err)
	}
	must(t, d.Remove(".exit-prev"))
	if b, err := os.ReadFile(target); err != nil || string(b) != "root's" {
		t.Errorf("the link's target after Remove: %q, %v", b, err)
	}
	for _, bad := range []string{"../x", "a/b", "", ".."} {
		if d.Rename("x", bad) == nil || d.Remove(bad) == nil {
			t.Errorf("Rename or Remove accepted the name %q", bad)
		}
	}
}
