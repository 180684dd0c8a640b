package rootpath

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// OpenOwnFile writes into no file it did not create, and follows no link: whatever another user left at
// the path is removed and a file of root's made in its place; root's own file is opened as it is.
func TestOpenOwnFile(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root to give a file to another user")
	}
	dir := t.TempDir()
	outside := filepath.Join(dir, "outside")
	for _, tt := range []struct {
		name  string
		plant func(p string) error
		kept  bool // root's own, opened as it is
	}{
		{"nothing there", func(string) error { return nil }, false},
		{"root's own file", func(p string) error { return os.WriteFile(p, []byte("x"), 0o600) }, true},
		{"another user's file", func(p string) error { return os.WriteFile(p, []byte("x"), 0o666) }, false},
		{"a link", func(p string) error { return os.Symlink(outside, p) }, false},
		{"a FIFO", func(p string) error { return syscall.Mkfifo(p, 0o666) }, false},
		{"a directory", func(p string) error { return os.Mkdir(p, 0o777) }, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "f")
			if err := tt.plant(p); err != nil {
				t.Fatal(err)
			}
			if !tt.kept {
				os.Lchown(p, 1000, 1000) // nothing there: no such file
			}
			f, err := OpenOwnFile(p, os.O_APPEND)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			fi, err := f.Stat()
			if err != nil {
				t.Fatal(err)
			}
			if !fi.Mode().IsRegular() || Owner(fi) != 0 || (!tt.kept && fi.Mode().Perm() != 0o600) {
				t.Errorf("opened %v of uid %d; want a regular file of root's, 0600", fi.Mode(), Owner(fi))
			}
			// Its byte tells root's own file, opened as it is (not truncated), from the one made in its place.
			if kept := fi.Size() == 1; kept != tt.kept {
				t.Errorf("the file there before was kept: %v, want %v", kept, tt.kept)
			}
			if _, err := os.Lstat(outside); err == nil {
				t.Errorf("a file was made through the planted link")
			}
		})
	}
}
